"""RMSNorm as one compiled kernel: a load-time transform for a decode step replayed from a CUDA graph.

A graph removes the launch cost of a step, not its kernels: on an H200 the 0.6B shapes' graphed step is
1,636 kernels of ~2 us each (3.25 ms), and over half of them are RMSNorm's pieces. Each of a step's 113
norms (4 a layer: input, q, k, post-attention; and the final one) is 8 eager kernels: cast to fp32, pow,
mean, add eps, rsqrt, multiply, cast back, multiply by the weight (docs/performance.md, "The first H200 run").
inductor makes the same maths one kernel per norm (a reduction and its pointwise ops fused); the products
stay cuBLAS's. The weights, names and the checkpoint are untouched: each RMSNorm module's class is swapped for
`CompiledRMSNorm`, and `uncompile_norms` swaps it back.

Exactness: the same fp32 maths in the same order of operations, but inductor sums the squares in its own
order, so a norm's fp32 result can differ from the eager one in its last bit, and after the cast to bf16 an
element can round the other way. Greedy tokens are unchanged in practice (tests/test_compiled_norms.py, fp32
and bf16 on a CPU, where inductor emits C++ for the same graph); logits are no longer bit-identical to
transformers', which is why this is opt-in (`--compile` is the whole-model equivalent).

Shapes are dynamic (one compile per rank: (B, T, C) hidden states and (B, T, heads, D) q/k), so a prefill of
any length reuses the kernels a decode step compiled.
"""

import torch

from qwen3_scratch.model.qwen3 import RMSNorm, rms_norm

_compiled = None


def compiled_rms_norm():
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(rms_norm, dynamic=True, fullgraph=True)
    return _compiled


class CompiledRMSNorm(RMSNorm):
    """An RMSNorm whose forward is one inductor kernel (same parameters and state dict)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return compiled_rms_norm()(x, self.weight, self.eps)


def compile_norms(model: torch.nn.Module) -> int:
    """Swap every RMSNorm of model for CompiledRMSNorm, in place; returns how many."""
    norms = [m for m in model.modules() if type(m) is RMSNorm]
    for m in norms:
        m.__class__ = CompiledRMSNorm
    return len(norms)


def uncompile_norms(model: torch.nn.Module) -> int:
    """Undo compile_norms; returns how many norms were swapped back."""
    norms = [m for m in model.modules() if type(m) is CompiledRMSNorm]
    for m in norms:
        m.__class__ = RMSNorm
    return len(norms)
