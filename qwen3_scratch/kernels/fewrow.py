"""Products of a few activation rows (2 to 16) with a bf16 matrix on a CPU, the rows sharing one read of it.

Speculative decoding (generation/speculative.py) checks k proposed tokens in one forward over k+1
positions. That only pays if k+1 rows cost about what one row costs: decode is bound by reading the
weights, and k+1 rows still read each weight once, if the kernel lets them. torch's F.linear (oneDNN)
does not, for bf16 at these sizes: 5 rows of Qwen3-0.6B's matrices take ~2x the time of the compiled
one-row loop (matvec.py), so a verification forward would cost two decode steps. Inductor, given
`(W.float()[None] * x[:, None]).sum(-1)`, does worse (~2.8x): it converts each weight to fp32 once
per row. The CPU has an instruction for exactly this product, AVX512-BF16's `vdpbf16ps`, which
multiplies 32 bf16 pairs and adds them into 16 fp32 sums; the loop below is:

    for each output row n (rows split across threads):        # one pass over W, row by row
        load 64 weights of W[n]                              # read once ...
        for each activation row r:  acc[r] += x[r] . W[n]    # ... used by every row, in fp32
        y[r, n] = bf16(sum of acc[r])                        # round once, as F.linear does

It is C++ with intrinsics, compiled once per process by inductor's C++ toolchain (the one matvec.py
uses; its binary is cached on disk), with the same OpenMP as torch's own kernels. Measured at the
0.6B shapes on a 2-core Zen 4 (scripts/bench/benchmark_speculative.py --only costs; docs/performance.md,
"Speculative decoding"): a whole verification forward over 5 rows (k = 4) costs 1.37 one-row decode
steps with this kernel, 2.55 with F.linear; 2 rows cost 0.93.

Exactness: each output is an fp32 sum of exact bf16 x bf16 products, rounded once to bf16, like
F.linear's, in another order; so it equals F.linear to bf16 rounding (tests/test_fewrow.py).
Where it cannot run (no AVX512-BF16, no compiler, other dtypes), F.linear runs, as before.

Shapes: R activation rows, N out_features, K in_features.
"""

import ctypes
import functools
import warnings

import torch
import torch.nn.functional as F

from . import aot
from .matvec import MatvecLinear

MAX_ROWS = 16  # a verification of up to 15 proposed tokens; more rows than this go to F.linear

SOURCE = r"""
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

static inline uint16_t round_to_bf16(float f) {  // round to nearest even, as torch's .to(bfloat16)
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

// y (R, N) = x (R, K) @ w (N, K)^T, all bf16 (as uint16), sums in fp32.
// Two accumulators per row while registers allow (hides the instruction's latency), one beyond.
template <int R, int U>
__attribute__((target("avx512f,avx512bw,avx512bf16")))
static void rows(const uint16_t* x, const uint16_t* w, uint16_t* y, int64_t N, int64_t K) {
    // Every loop over r and u is unrolled, so that acc lives in registers: one loop left rolled
    // indexes acc by a variable, and the compiler then keeps it in memory (measured 1.5x slower at R = 4).
    #pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint16_t* wn = w + n * K;
        __m512 acc[R][U];
        #pragma GCC unroll 16
        for (int r = 0; r < R; r++) {
            #pragma GCC unroll 2
            for (int u = 0; u < U; u++) acc[r][u] = _mm512_setzero_ps();
        }
        int64_t k = 0;
        for (; k + 32 * U <= K; k += 32 * U) {
            #pragma GCC unroll 2
            for (int u = 0; u < U; u++) {
                __m512bh wk = (__m512bh)_mm512_loadu_si512(wn + k + 32 * u);
                #pragma GCC unroll 16
                for (int r = 0; r < R; r++)
                    acc[r][u] = _mm512_dpbf16_ps(acc[r][u], (__m512bh)_mm512_loadu_si512(x + r * K + k + 32 * u), wk);
            }
        }
        for (; k < K; k += 32) {  // the tail: masked loads read zeros past K
            __mmask32 m = K - k >= 32 ? 0xffffffffu : (1u << (K - k)) - 1u;
            __m512bh wk = (__m512bh)_mm512_maskz_loadu_epi16(m, wn + k);
            #pragma GCC unroll 16
            for (int r = 0; r < R; r++)
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], (__m512bh)_mm512_maskz_loadu_epi16(m, x + r * K + k), wk);
        }
        #pragma GCC unroll 16
        for (int r = 0; r < R; r++) {
            __m512 sum = acc[r][0];
            #pragma GCC unroll 2
            for (int u = 1; u < U; u++) sum = _mm512_add_ps(sum, acc[r][u]);
            y[r * N + n] = round_to_bf16(_mm512_reduce_add_ps(sum));
        }
    }
}

#define CASE(r) case r: rows<r, (r <= 8 ? 2 : 1)>(x, w, y, N, K); return 0;
extern "C" int fewrow_bf16(const uint16_t* x, const uint16_t* w, uint16_t* y, int64_t R, int64_t N, int64_t K) {
    switch (R) {
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
        CASE(9) CASE(10) CASE(11) CASE(12) CASE(13) CASE(14) CASE(15) CASE(16)
    }
    return 1;  // more rows than MAX_ROWS: the caller uses F.linear
}
"""


@functools.cache
def _library():
    """The compiled C function (built once per machine and kept in aot.py's cache; checked by unavailable_reason)."""
    library = aot.load_library("fewrow", SOURCE)  # kept by an earlier process: no compiler imported
    if library is None:
        from torch._inductor.codecache import CppCodeCache  # the compiler, imported only by the process that needs it

        library = CppCodeCache.load(SOURCE)
        aot.keep_library("fewrow", SOURCE, library._name)
    function = library.fewrow_bf16
    function.restype = ctypes.c_int
    return function


def fewrow(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x (R, K) bf16 times weight (N, K) bf16 transposed -> (R, N) bf16; both contiguous, 1 <= R <= MAX_ROWS."""
    R, K = x.shape
    N = weight.shape[0]
    y = torch.empty(R, N, dtype=torch.bfloat16)
    pointer = ctypes.c_void_p
    _library()(pointer(x.data_ptr()), pointer(weight.data_ptr()), pointer(y.data_ptr()), R, N, K)
    return y


@functools.cache
def unavailable_reason() -> str | None:
    """None if the kernel runs here and gives the right answer; otherwise why not."""
    if not torch.cpu._is_avx512_bf16_supported():
        return "the CPU has no AVX512-BF16"
    try:
        x = torch.arange(3 * 40, dtype=torch.bfloat16).view(3, 40) / 64  # K = 40: the masked tail too
        w = torch.ones(5, 40, dtype=torch.bfloat16)
        if not torch.equal(fewrow(x, w), F.linear(x.float(), w.float()).bfloat16()):  # exact: small integers / 64
            return "the compiled product gave a wrong answer"
    except Exception as error:  # any failure of the toolchain means: keep F.linear
        return aot.failure(error)
    return None


class FewRowLinear(MatvecLinear):
    """MatvecLinear whose products of 2..MAX_ROWS rows run the shared-read loop above (bf16 weights)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if not 1 < rows <= MAX_ROWS or x.dtype != torch.bfloat16 or torch.compiler.is_compiling():
            return super().forward(x)
        y = fewrow(x.reshape(rows, self.in_features).contiguous(), self.weight)  # (R, N)
        y = y.view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


@torch.no_grad()
def use_fewrow(model) -> bool:
    """Give every MatvecLinear of a bf16 CPU model the few-row path; False (with a warning) where it
    cannot run. Called after matvec.use_matvec, by layout.py's "decode" layout."""
    weight = model.model.embed_tokens.weight
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16:
        return False  # fp32 and fp16 keep F.linear (fp32's few-row products were not measured slow)
    reason = unavailable_reason()
    if reason is not None:
        if torch.cpu._is_avx512_bf16_supported():  # a CPU without the instruction is no news
            warnings.warn(f"the few-row bf16 kernel is unavailable ({reason}); using F.linear", stacklevel=2)
        return False
    for module in model.modules():
        if type(module) is MatvecLinear and module.weight.dtype == torch.bfloat16:
            module.__class__ = FewRowLinear
    model.fewrow = True  # what speculative decoding's cost model reads (generation/speculative.forward_cost)
    return True
