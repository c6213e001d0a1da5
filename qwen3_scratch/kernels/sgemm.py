"""fp32 products of several rows on a CPU not made by Intel: oneDNN's matmul instead of MKL's.

torch's fp32 F.linear on a CPU calls MKL's sgemm. MKL picks its kernels by the CPU's vendor, and on an AMD
EPYC it runs far below the CPU's speed at the row counts of a prompt: 16-28 GFLOP/s at 16 rows on a 2-core
Zen 3, where the memory and the CPU's two FMA units a core would allow several times that. oneDNN (in every torch
x86 build; the engine's prepacked products already use it, fuse.py) multiplies the same dense matrix, with no
copy of it and no extra memory, about twice as fast there:

    torch.ops.mkldnn._linear_pointwise(W, x, None, "none", [], "").T   # == F.linear(x, W) in fp32

Measured on the Zen 3, 16 rows times 28 layers' matrices of the 0.6B shapes (out of cache), GB/s of weights and
GFLOP/s (scripts/bench/benchmark_matvec.py --rows 16 --dtypes float32; docs/performance.md, "fp32 products on an
AMD CPU"):

    16 rows               q/k/v        o            gate/up      down         lm_head
    F.linear (MKL)        2.7 (21.5)   3.5 (27.8)   2.3 (18.3)   3.5 (27.9)   2.1 (16.6)
    oneDNN, same matrix   4.1 (32.8)   4.7 (37.2)   5.4 (43.3)   4.3 (34.3)   5.9 (47.1)

and at 300 rows oneDNN's was still 1.04-1.57x faster. That was oneDNN's product with the rows as its input;
`onednn` now swaps the roles, another 1.15-1.6x at 8-32 rows (below).

Every fp32 product of more than one row on the CPU goes through `linear` or `mm`: MatvecLinear's prompts in fp32
and the widened products of bf16, int8 and int4 rows (widen.py). One row runs matvec.py's compiled loop instead.
A widened block of 512 rows (2 MB, in the caches) times 300 rows ran 5-10% faster by MKL (benchmark_matvec.py
--rows 300 --dtypes bfloat16), so `mm` keeps MKL from MKL_BLOCK_ROWS rows on.

On an Intel CPU MKL runs its own fast kernels, and F.linear is kept. QWEN3_SCRATCH_SGEMM=mkl or =onednn
overrides the choice (benchmarks compare the two in one run).

Exactness: both are fp32 sums of exact fp32 products; only the order of the sums differs (fp32 rounding,
tests/test_sgemm.py).

Shapes: R rows, N out_features, K in_features.
"""

import contextlib
import functools
import os
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

CHOICES = ("mkl", "onednn")
MKL_BLOCK_ROWS = 256  # a widened block (widen.py) times this many rows or more: MKL's product is as fast or faster
_chosen: str | None = None  # set by `choose`


def uses_onednn() -> bool:
    """True when several-row fp32 products run through oneDNN here: a CPU not made by Intel (where MKL runs
    generic kernels), or QWEN3_SCRATCH_SGEMM=onednn; False on an Intel CPU or with QWEN3_SCRATCH_SGEMM=mkl."""
    if _chosen is not None:
        return _chosen == "onednn" and torch.backends.mkldnn.is_available()
    return default_uses_onednn()


@contextlib.contextmanager
def choose(choice: str):
    """Inside the block, several-row fp32 products run by `choice`, "mkl" or "onednn" (benchmarks and tests
    compare the two in one process)."""
    global _chosen
    if choice not in CHOICES:
        raise ValueError(f"sgemm choice {choice!r}: use one of {', '.join(CHOICES)}")
    previous, _chosen = _chosen, choice
    try:
        yield
    finally:
        _chosen = previous


@functools.cache
def default_uses_onednn() -> bool:
    """uses_onednn's answer from the CPU's vendor and QWEN3_SCRATCH_SGEMM."""
    choice = os.environ.get("QWEN3_SCRATCH_SGEMM", "").strip().lower()
    if choice and choice not in CHOICES:
        warnings.warn(f"QWEN3_SCRATCH_SGEMM={choice!r} is not one of {', '.join(CHOICES)}; ignored", stacklevel=2)
        choice = ""
    if not torch.backends.mkldnn.is_available():
        return False
    if choice:
        return choice == "onednn"
    return torch.backends.mkl.is_available() and cpu_vendor() not in ("", "GenuineIntel")


@functools.cache
def cpu_vendor() -> str:
    """The CPU's vendor_id ("GenuineIntel", "AuthenticAMD", ...), or "" where /proc/cpuinfo says none."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("vendor_id"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def applies(x: torch.Tensor) -> bool:
    """True when x's rows (fp32, on the CPU, eager) multiply through oneDNN here."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and uses_onednn()
            and not torch.compiler.is_compiling())  # (compiled: F.linear is traced, and inductor picks)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias): x (..., K), weight (N, K) -> (..., N); through oneDNN where `applies`."""
    if not applies(x) or weight.dtype != torch.float32:
        return F.linear(x, weight, bias)
    y = onednn(x.reshape(-1, x.shape[-1]).contiguous(), weight, bias)  # (R, N)
    return y.view(*x.shape[:-1], weight.shape[0])


def mm(rows: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = rows @ weight.T in fp32: rows (R, K), weight (N, K), out (R, N), a view that may be strided.
    widen.products' product of one block; from MKL_BLOCK_ROWS rows on MKL's is kept (measured faster there)."""
    if applies(rows) and len(rows) < MKL_BLOCK_ROWS:
        return out.copy_(onednn_transposed(rows, weight).t())
    return torch.mm(rows, weight.t(), out=out)


def onednn(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """oneDNN's product of rows (R, K) and the dense weight (N, K), transposed, plus bias -> (R, N) fp32.

    Computed the other way round, weight @ rows.T: the matrix as oneDNN's input and the few rows as its weight,
    then transposed back (a copy of R x N, ~3% of the product at 16 rows), which runs faster at a prompt's row
    counts. On the AMD EPYC Zen 3 (2 threads, GFLOP/s, 28 layers' matrices of the 0.6B shapes out of cache / a
    widened 512-row block in cache, two runs): 8 rows 39-43 -> 50-55 / 52 -> 59-83; 16 rows 64-65 -> 92-95 / 65 ->
    87-102; 32 rows 86-88 -> 99-104 / 79-84 -> 97-109; 64 and more rows level within the noise. A 16-token prompt
    of the 0.6B shapes: fp32 370 -> 327 ms, bf16 (widened) 519 -> 483 ms (docs/performance.md)."""
    y = onednn_transposed(rows, weight).t().contiguous()  # (R, N)
    return y if bias is None else y.add_(bias)


def onednn_transposed(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """weight @ rows.T by oneDNN, the matrix as its input and the rows as its weight (onednn says why): (N, R) fp32."""
    return torch.ops.mkldnn._linear_pointwise(weight, rows, None, "none", [], "")
