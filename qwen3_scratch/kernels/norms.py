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

`fuse_norms` is the route with no compile at all: torch's own RMSNorm kernel (`F.rms_norm`; one fused kernel
on CUDA) normalises in fp32 and casts back, then the weight multiplies in the activations' dtype, as before.
Two kernels a norm instead of eight, ready at once. Its sum of squares is also ordered its own way, so the same
caveat holds; on a CPU it equals the eager norm bit for bit (tested), on a GPU gpu_check counts the elements
that differ (`bfloat16/graphs-fused`).
"""

import torch
import torch.nn.functional as F

from qwen3_scratch.model.qwen3 import RMSNorm, rms_norm

_compiled = None


def compiled_rms_norm():
    global _compiled
    if _compiled is None:
        # emulate_precision_casts: round to bf16 where the eager code casts (before the weight's product),
        # not once at the end; without it a quarter of bf16 outputs differ in their last bit, with it ~1e-5
        _compiled = torch.compile(rms_norm, dynamic=True, fullgraph=True, options={"emulate_precision_casts": True})
    return _compiled


class CompiledRMSNorm(RMSNorm):
    """An RMSNorm whose forward is one inductor kernel (same parameters and state dict)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return compiled_rms_norm()(x, self.weight, self.eps)


class FusedRMSNorm(RMSNorm):
    """An RMSNorm whose normalisation is torch's fused kernel, the weight applied after the cast back."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * F.rms_norm(x, self.weight.shape, eps=self.eps)


def _swap(model: torch.nn.Module, old: type, new: type) -> int:
    norms = [m for m in model.modules() if type(m) is old]
    for m in norms:
        m.__class__ = new
    return len(norms)


def compile_norms(model: torch.nn.Module) -> int:
    """Swap every RMSNorm of model for CompiledRMSNorm, in place; returns how many."""
    return _swap(model, RMSNorm, CompiledRMSNorm)


def uncompile_norms(model: torch.nn.Module) -> int:
    """Undo compile_norms; returns how many norms were swapped back."""
    return _swap(model, CompiledRMSNorm, RMSNorm)


def fuse_norms(model: torch.nn.Module) -> int:
    """Swap every RMSNorm of model for FusedRMSNorm (torch's fused kernel), in place; returns how many."""
    return _swap(model, RMSNorm, FusedRMSNorm)


def unfuse_norms(model: torch.nn.Module) -> int:
    """Undo fuse_norms; returns how many norms were swapped back."""
    return _swap(model, FusedRMSNorm, RMSNorm)


def norm_mismatch(dim: int, device, dtype=torch.bfloat16, rows: int = 4096, seed: int = 0) -> dict:
    """The fraction of output elements in which each route's norm differs from the eager one, over `rows`
    random rows of width `dim` (activations of a few scales, a weight near 1, as a trained model's are)."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(rows, dim, generator=g, device=device) * torch.rand(rows, 1, generator=g, device=device) * 8
    weight = 1 + 0.1 * torch.randn(dim, generator=g, device=device)
    x, weight = x.to(dtype), weight.to(dtype)
    eager = rms_norm(x, weight, 1e-6)
    routes = {"fused": lambda: weight * F.rms_norm(x, (dim,), eps=1e-6),
              "compiled": lambda: compiled_rms_norm()(x, weight, 1e-6)}  # fmt: skip
    return {name: (route() != eager).float().mean().item() for name, route in routes.items()}
