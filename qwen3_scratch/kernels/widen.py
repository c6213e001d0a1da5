"""Products of many bf16 (or fp16) rows on a CPU without bf16 instructions, run in fp32.

A CPU without avx512_bf16 or AMX (AVX2 only, as the AMD EPYC Zen 3; AVX-512 without its bf16 part) has
no instruction that multiplies bf16, so torch's bf16 F.linear there is slow at every size: one 6144 x 1024
matrix of the 0.6B shapes took 229 ms for 300 rows, against 45 ms widened as below (2-core Zen 3).
A prompt is such a product, so a 300-token prompt of the 0.6B shapes waited 16.5 s for its first token in
bf16, against 3.9 s in fp32 (docs/performance.md, "Prompts in bf16 on a CPU without bf16 instructions").

Here the matrix is widened to fp32 a block of BLOCK_ROWS rows at a time, into one buffer that stays in the
caches, and torch's fp32 product (the CPU's fastest) multiplies the rows by each block:

    y[:, block] = x.float() @ W[block].float().T          rounded once to the activations' dtype at the end

From about 8 rows on this is faster; below, F.linear is as fast or faster (one row is matvec.py's loop).
Measured on the Zen 3, ms for one matrix (6144 x 1024 / 1024 x 3072):

    rows              4             8             16            64            300
    bf16 F.linear     5.1 / 2.6     7.7 / 2.9     12.6 / 5.6    48.8 / 21.8   229 / 103
    widened           4.9 / 2.4     6.0 / 2.8     6.2 / 5.1     17.2 / 5.8    45 / 20

Exactness: a product of two bf16 (or fp16) numbers is exact in fp32 and the sums are fp32, as in torch's own
bf16 kernels; only the order of the sums differs (fp32 rounding), then the one rounding to bf16
(tests/test_widen.py holds it to that against the fp32 product).

Shapes: R rows, N out_features, K in_features.
"""

import functools
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .fuse import replace_linears

MIN_ROWS = 8  # fewer rows run torch's own kernel (F.linear), as fast or faster there
BLOCK_ROWS = 512  # rows of the matrix widened at a time: 2 MB of fp32 at K = 1024 (128 and 2048 were slower)
HALF = (torch.bfloat16, torch.float16)


@functools.cache
def cpu_has_native_bf16() -> bool:
    """True when the CPU multiplies bf16 in hardware (avx512_bf16 / AMX) and oneDNN will use it."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux: trust oneDNN's own check alone
        flags = "avx512_bf16"
    native = "avx512_bf16" in flags or "amx_bf16" in flags
    return native and torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def widens(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when x's rows times weight run faster widened: MIN_ROWS or more half-precision rows on a CPU
    without bf16 instructions."""
    rows = x.numel() // weight.shape[1]
    return weight.device.type == "cpu" and weight.dtype in HALF and rows >= MIN_ROWS and not cpu_has_native_bf16()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) in fp32, rounded once to x's dtype: x (..., K), weight (N, K) -> (..., N)."""
    N, K = weight.shape
    rows = x.reshape(-1, K).float()  # (R, K)
    y = torch.empty(len(rows), N)  # (R, N) fp32
    block = torch.empty(min(BLOCK_ROWS, N), K)  # fp32, reused for every block of the matrix
    for start in range(0, N, BLOCK_ROWS):
        end = min(start + BLOCK_ROWS, N)
        widened = block[: end - start]
        widened.copy_(weight[start:end])
        torch.mm(rows, widened.t(), out=y[:, start:end])
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype).view(*x.shape[:-1], N)


class WideLinear(nn.Module):
    """nn.Linear over the same weight whose products of MIN_ROWS or more rows run widened (`linear`): the
    "batch" layout's matrices in bf16 on a CPU without bf16 instructions, where oneDNN packs none (fuse.py)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.split_sizes = getattr(linear, "split_sizes", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if widens(x, self.weight) and not torch.compiler.is_compiling():
            return linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


@torch.no_grad()
def use_widened(model: nn.Module) -> nn.Module:
    """Every nn.Linear outside a MoE block becomes a WideLinear, in place, where that pays: a CPU model in
    bf16 or fp16 on a CPU without bf16 instructions. Elsewhere the model is left as it is."""
    weight = model.model.embed_tokens.weight
    if weight.device.type == "cpu" and weight.dtype in HALF and not cpu_has_native_bf16():
        replace_linears(model, WideLinear)
    return model
