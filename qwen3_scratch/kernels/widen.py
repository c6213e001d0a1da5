"""Products of many bf16 (or fp16) rows on a CPU without bf16 instructions, run in fp32.

A CPU without avx512_bf16 or AMX (AVX2 only, as the AMD EPYC Zen 3; AVX-512 without its bf16 part) has
no instruction that multiplies bf16, so torch's bf16 F.linear there is slow at every size: one 6144 x 1024
matrix of the 0.6B shapes took 229 ms for 300 rows, against 45 ms widened as below (2-core Zen 3).
A prompt is such a product, so a 300-token prompt of the 0.6B shapes waited 16.5 s for its first token in
bf16, against 3.9 s in fp32 (docs/performance.md, "Prompts in bf16 on a CPU without bf16 instructions").

Here the matrix is widened to fp32 a block of BLOCK_ROWS rows at a time, into one buffer that stays in the
caches, and the CPU's fastest fp32 product (sgemm.py: oneDNN's on a CPU not made by Intel, MKL's on an Intel
one) multiplies the rows by each block:

    y[:, block] = x.float() @ W[block].float().T          rounded once to the activations' dtype at the end

From 6 rows on this is faster; below, F.linear is as fast or faster (one row is matvec.py's loop).
Measured on the Zen 3, weight GB/s for 28 layers' matrices (out of cache; scripts/bench/benchmark_matvec.py
--rows R --dtypes bfloat16), the widened product's fp32 part by oneDNN (by MKL: 12 rows were the crossover):

    rows                     4            6            8            16
    q/k/v  F.linear          3.7          2.4          1.9          1.0
           widened           2.3          2.2          2.2          1.7
    down   F.linear          4.0          2.8          2.2          1.1
           widened           2.8          3.1          2.8          2.1

and at 300 rows one 6144 x 1024 matrix took 229 ms through bf16 F.linear, 45 ms widened. Since oneDNN's product
runs the other way round (sgemm.onednn; 2026-12-07, a faster hour of that host), at 4 / 6 rows F.linear reads
4.4-4.8 / 2.4-3.4 GB/s against widened 2.8-4.5 / 2.9-4.1 across the five shapes (q/k/v, o, gate/up, down, lm_head):
at 6 rows widened is 1.07-1.34x F.linear on every one, at 4 slower on every one.

int8 and int4 matrices (quantize.py, int4.py) take bf16 rows wherever they run on a CPU (placement.pick_dtype),
and torch's int8 and int4 kernels are faster than F.linear there but still slow with many rows: a block of codes
is widened (int8, `linear_int8`) or unpacked and dequantized (int4, from torch's own packing: int4.py hands
`products` its blocks) the same way, from MIN_INT8_ROWS and MIN_INT4_ROWS rows on. ms for one matrix, torch's
kernel / widened (oneDNN's fp32 products):

    rows              16            32            64            128           160
    int8 6144x1024    4.7 / 6.4     8.4 / 7.7     15.9 / 11.0   33.1 / 18.9   37.8 / 21.1
    int8 1024x3072    1.9 / 3.0     3.9 / 4.0     7.0 / 5.8     12.9 / 8.8    17.9 / 12.1
    int4 6144x1024    5.1 / 22.4    9.8 / 24.4    18.3 / 31.9   37.7 / 42.7   43.7 / 40.6
    int4 1024x3072    2.3 / 15.6    4.5 / 15.7    8.6 / 16.2    12.9 / 19.1   20.9 / 22.2

A 300-token prompt's first token: int8 6.4 -> 3.6 s, int4 6.6 -> 4.5 s (MKL's fp32 products). With oneDNN's
product the other way round (sgemm.onednn), 8 layers' int8 matrices of the 0.6B shapes at 16 / 24 / 32 / 48 rows took
77-85 / 114-123 / 145-168 / 189-238 ms through torch's kernel and 96-103 / 103-126 / 117-122 / 146-161 ms widened
(two runs; 2026-12-07): widened from 32 rows.

Exactness: a product of two bf16 (or fp16) numbers is exact in fp32, and so is a bf16 row's number times an int8
code or an int4 weight dequantized in fp32 (int4.dequantize's); the sums are fp32, as in torch's own kernels. Only
the order of the sums differs (fp32 rounding), then the one rounding to bf16 (tests/test_widen.py holds each to
that against the exact product).

Shapes: R rows, N out_features, K in_features.
"""

import functools
from pathlib import Path

import torch
from torch import nn

from . import sgemm
from .fuse import replace_linears

MIN_ROWS = 6  # fewer rows run torch's own kernel (F.linear), as fast or faster there
MIN_INT8_ROWS = 32  # the same for torch's int8 kernel (its crossover: ~24 rows since oneDNN's turned around)
MIN_INT4_ROWS = 160  # and its int4 one, which unpacks the nibbles first (crossover: 128-160 rows)
MIN_INT4_WORDS_ROWS = 64  # int4 in the words layout (int4.py, AVX2 CPUs), dequantized faster (crossover: 48-64)
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


def widens(x: torch.Tensor, in_features: int, min_rows: int = MIN_ROWS) -> bool:
    """True when x's rows run faster widened: min_rows or more half-precision rows on a CPU without bf16
    instructions (min_rows: MIN_ROWS for float matrices, MIN_INT8_ROWS or MIN_INT4_ROWS for quantized ones)."""
    rows = x.numel() // in_features
    return x.device.type == "cpu" and x.dtype in HALF and rows >= min_rows and not cpu_has_native_bf16()


def products(x: torch.Tensor, n: int, fill) -> torch.Tensor:
    """x (..., K) times an (n, K) matrix given a block at a time, in fp32: fill(block, start, end) writes rows
    start:end of the matrix into block, (end - start, K) fp32. -> (R, n) fp32."""
    K = x.shape[-1]
    rows = x.reshape(-1, K).float()  # (R, K)
    y = torch.empty(len(rows), n)  # (R, n) fp32
    block = torch.empty(min(BLOCK_ROWS, n), K)  # reused for every block of the matrix
    for start in range(0, n, BLOCK_ROWS):
        end = min(start + BLOCK_ROWS, n)
        fill(block[: end - start], start, end)
        sgemm.mm(rows, block[: end - start], out=y[:, start:end])
    return y


def product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), widened (`linear`) where that pays: several rows of a float matrix (MatvecLinear's
    prompts, WideLinear's batches). fp32 rows go through sgemm.linear (oneDNN where MKL is slow)."""
    if widens(x, weight.shape[1]) and not torch.compiler.is_compiling():  # (compiled: F.linear traced)
        return linear(x, weight, bias)
    return sgemm.linear(x, weight, bias)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) in fp32, rounded once to x's dtype: x (..., K), weight (N, K) -> (..., N)."""
    y = products(x, len(weight), lambda block, start, end: block.copy_(weight[start:end]))
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype).view(*x.shape[:-1], len(weight))


def linear_int8(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """torch._weight_int8pack_mm(x, codes, scales) in fp32: x (..., K), codes (N, K) int8, one scale a row (N,)
    -> (..., N) in x's dtype. A code times a bf16 number is exact in fp32, so only the sums' order differs."""
    y = products(x, len(codes), lambda block, start, end: block.copy_(codes[start:end]))
    return (y * scales.float()).to(x.dtype).view(*x.shape[:-1], len(codes))


class WideLinear(nn.Module):
    """nn.Linear over the same weight whose products of MIN_ROWS or more rows run widened (`product`): the
    "batch" layout's matrices in bf16 on a CPU without bf16 instructions, where oneDNN packs none (fuse.py)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.split_sizes = getattr(linear, "split_sizes", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return product(x, self.weight, self.bias)


@torch.no_grad()
def use_widened(model: nn.Module) -> nn.Module:
    """Every nn.Linear outside a MoE block becomes a WideLinear, in place, where that pays: a CPU model in
    bf16 or fp16 on a CPU without bf16 instructions. Elsewhere the model is left as it is."""
    weight = model.model.embed_tokens.weight
    if weight.device.type == "cpu" and weight.dtype in HALF and not cpu_has_native_bf16():
        replace_linears(model, WideLinear)
    return model
