"""Matrix-vector products for batch-1 decode on a CPU, compiled by inductor into one streaming loop.

A decode step multiplies one activation row by every weight matrix, so its speed is the speed at
which those products stream the weights from memory. torch's eager kernels for a single row
(`F.linear`, `mv`, and oneDNN even with prepacked weights) read bf16 weights at 10-15 GB/s on a Zen 4
core pair whose copy bandwidth is ~30 GB/s (docs/performance.md). The same product written as plain
torch ops,

    y[n] = sum_k float(W[n, k]) * float(x[k])            (W.float() * x.float()).sum(-1)

is compiled by inductor into a single loop over W's rows: load a SIMD vector of weights, widen it to
fp32, multiply-add into two accumulators, one horizontal sum per row, rows split across threads.
Nothing the size of W is ever made, and W is read at ~the copy bandwidth. A decode's products cut their
matrices into about four slices of equal rows (slice_rows), which inductor sums in one loop: each thread then
streams from four places at once (a bf16 step 61 -> 51 ms on an AMD EPYC Zen 3). int8 weights (quantize.py)
run the same loop, reading a quarter of fp32's bytes, times the row's scale.

We hand the traced graph to inductor ourselves (`torch._inductor.compile`), once per shape and dtype:
no dynamo, so no guards are checked on each call (~7 µs a call instead of 25-50, with up to 7 products
per layer). The first compile in a process takes a few seconds (inductor's imports); each further
shape ~0.1 s, as inductor keeps the C++ it built on disk. `MatvecLinear` compiles its kernel when the
model is loaded, so a broken toolchain is found there, and the model falls back to oneDNN (fuse.py).
`kernel` compiles any small function this way; cpu_decode.py uses it for the ops between products.

Exactness: each output is an fp32 sum, as in torch's own kernels, in another order, so fp32 logits
equal the parity suite's within float rounding (1e-5 relative) and bf16 rounds that sum once.

Shapes: N out_features, K in_features.
"""

import functools
import math
import sys
import warnings

import torch
from torch import nn

from qwen3_scratch.model.qwen3 import Qwen3

from . import aot, widen
from .fuse import replace_linears

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# x comes in as fp32, widened once outside the loop: widening it inside would redo that for every row
# (int8 weights read at 11 GB/s that way, at 24 GB/s this way).


SPLIT = 4  # each row's sum in SPLIT quarters (see row_sums)
STREAMS = 4  # rows a product's loop reads at once, each from its own part of the matrices (see slice_rows)
INT8_WORDS_STREAMS = 2  # the same for int8's words loop, which holds more registers a row (matvec_int8_words)


def row_sums(x: torch.Tensor, weight: torch.Tensor, rows: int | None = None) -> torch.Tensor:
    """sum_k float(weight[n, k]) * x[k] for each row n, (N,) fp32: x (1, K) fp32, weight (N, K).

    Each row is summed as SPLIT runs of K/SPLIT, then the SPLIT partial sums: inductor's loop over one run
    then has a trip count the C++ compiler knows and unrolls, keeping more loads of the weight stream in
    flight. On the Intel Xeon (one row of a 65536 x 1024 bf16 matrix, out of cache) 14.5 -> 16.3 GB/s on
    2 threads, 7.0 -> 7.7 on one; 2, 8 or 16 runs were slower (docs/performance.md, "Two kernels a layer").

    rows: the matrix cut into slices of that many rows (slice_rows), each summed as above. Inductor fuses loops
    of the same size into one, so the slices' loops become one loop that sums a row of each slice at once: each
    thread then streams from as many places in the matrix, with an accumulator for each and x loaded once for all
    of them. The same sums as one slice, bit for bit."""
    N, K = weight.shape
    if rows is not None and rows < N:
        return torch.cat([row_sums(x, weight[start : start + rows]) for start in range(0, N, rows)])
    if K % (SPLIT * 32):  # no whole runs of 32 (one vector step of bf16): one run
        return (weight.float() * x).sum(-1)
    return (weight.view(N, SPLIT, K // SPLIT).float() * x.view(SPLIT, K // SPLIT)).sum(-1).sum(-1)


def slice_rows(*row_counts: int, streams: int = STREAMS) -> int:
    """Rows a slice for the products of one input row with these row counts (their matrices), so that their slices
    are all of one size, which inductor sums in one loop (row_sums), and there are about `streams` of them (STREAMS
    for float products, INT8_WORDS_STREAMS for int8's words): the largest common divisor of the counts, halved while
    there are fewer slices than that (and a slice keeps a multiple of 8 rows).

    Why: one product's loop read one place per thread, and did not keep the memory busy: on an AMD EPYC Zen 3 (2
    threads, out of cache) the lm_head's bf16 product read 18.3 GB/s as one slice, 23.1 as two and 26.0 as four;
    a 4096-row matrix 15.4 / 18.1 / 21.3 GB/s, eight slices 17.2 and sixteen 12.3 (docs/performance.md). Qwen3
    0.6B: q, k and v (2048, 1024, 1024 rows) in slices of 1024; gate and up (3072 each) of 1536; o and down (1024)
    of 256; the lm_head (151936) of 37984."""
    rows = math.gcd(*row_counts)
    while sum(row_counts) // rows < streams and rows % 16 == 0:
        rows //= 2
    return rows


def matvec(x: torch.Tensor, weight: torch.Tensor, rows: int | None = None) -> torch.Tensor:
    """x (1, K) fp32 times weight (N, K) transposed -> (N,) in weight's dtype, summed in fp32 (in slices of `rows`
    rows summed at once: row_sums)."""
    return row_sums(x, weight, rows).to(weight.dtype)


def as_buffer(t: torch.Tensor) -> torch.Tensor:
    """t as a buffer of its own in the kernel traced from it, in t's layout (inductor's way to ask for one), so the
    loops that read it load it rather than compute it again where they read it (int4_pairs' rounded rows). For
    functions compiled by kernel(); it imports inductor where called eagerly."""
    from torch._inductor import inductor_prims  # noqa: F401 (defines the op; the compiler is tracing this anyway)

    return torch.ops.prims.inductor_force_stride_order(t, t.stride())


def matvec_int8(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x (1, K) fp32, int8 weight (N, K), one scale per row (N,) in the activations' dtype -> (N,) in it.

    Equals x @ (weight * scales[:, None]).T: the scale is common to a row, so it multiplies the sum."""
    return ((weight.float() * x).sum(-1) * scales.float()).to(scales.dtype)


def matvec_int8_words(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor,
                      rows: int | None = None) -> torch.Tensor:  # fmt: skip
    """matvec_int8 over codes laid out four to a 32-bit word (quantize.interleave_columns): x (1, K) fp32,
    words (N, K/4) float32 holding the codes' bits (byte b of word j: the code of column b*K/4 + j), one
    scale per row (N,) -> (N,) in the scales' dtype.

    Why: on a CPU whose widest vectors are AVX2's, inductor loads every vector of int8 (or int32) values
    through a copy on the stack (at::vec's loadu with a count, which only float has a fast path for), and
    matvec_int8's loop read 1.2 GB/s of weights where the fp32 one reads 13.8 (AMD EPYC Zen 3,
    docs/performance.md). Here each load is a float vector of 8 words, 32 codes, then reinterpreted as int32
    (inductor's bitcast, a copy through the stack too, but one per 32 codes); two shifts sign-extend each byte,
    and each byte position multiplies its own quarter of x, contiguous: 10.7 GB/s. The same products as
    matvec_int8, summed in another order.

    rows: in slices of that many rows summed at once, as row_sums' (the same bits): a decode's whole-half kernels
    read two slices a product (INT8_WORDS_STREAMS)."""
    N = words.shape[0]
    if rows is not None and rows < N:
        return torch.cat([matvec_int8_words(x, words[start : start + rows], scales[start : start + rows])
                          for start in range(0, N, rows)])  # fmt: skip
    codes = words.view(torch.int32)  # (N, K/4)
    quarters = x.view(4, words.shape[1])  # quarters[b, j] = x[b*K/4 + j]
    c0, c1, c2, c3 = (((codes << shift) >> 24).float() for shift in (24, 16, 8, 0))  # bytes 0-3, sign-extended
    sums = (c0 * quarters[0] + c1 * quarters[1]) + (c2 * quarters[2] + c3 * quarters[3])  # (N, K/4)
    return (sums.sum(-1) * scales.float()).to(scales.dtype)


def cpu_reads_words() -> bool:
    """True on a CPU whose widest vectors are AVX2's (little-endian, as every x86 is): there inductor's loops load
    integer codes at full speed only as float32 words (matvec_int8_words; int4.words_product)."""
    return torch.backends.cpu.get_cpu_capability() == "AVX2" and sys.byteorder == "little"


_KERNELS: dict[tuple, object] = {}  # (function, device, shapes and dtypes of its arguments) -> compiled callable


def kernel(fn, *args: torch.Tensor, **constants):
    """fn(*args, **constants) compiled for exactly these argument shapes, dtypes and device (and constants),
    obtained on first use and kept. Every call must pass contiguous tensors of those shapes and dtypes.

    On a CPU, a kernel packaged by an earlier process is loaded without the compiler (aot.py); otherwise
    inductor builds it, and the CLI hands it to a background builder for later starts (aot_build.py). Both
    give the same bits (aot_build keeps a package only then). On a GPU (gpu_decode.py) inductor builds it,
    and its cache on disk spares most of that at later starts.
    """
    device = args[0].device
    key = (fn.__qualname__, device, *((tuple(a.shape), a.dtype) for a in args), *sorted(constants.items()))
    compiled = _KERNELS.get(key)
    if compiled is None:
        stored = device.type == "cpu"  # aot.py packages CPU kernels only
        compiled = aot.load(fn, args, constants) if stored else None
        if compiled is None:
            compiled = jit_kernel(fn, args, constants)
            if stored:
                aot.remember(fn, args, constants)
        _KERNELS[key] = compiled
    return compiled


def stored_kernel(fn, *args: torch.Tensor, **constants):
    """fn's kernel for these argument shapes when an earlier process stored it (aot.py), else None: the caller runs
    fn eagerly, and the kernel is handed to the background builder for later starts. For loops that run once a
    start and give the compiled kernel's bits eagerly too (exact operations only: quantizing at load), where
    building them (~2.5 s a kernel) would cost a first start more than running them eagerly."""
    device = args[0].device
    key = ("stored", fn.__qualname__, device, *((tuple(a.shape), a.dtype) for a in args), *sorted(constants.items()))
    if key not in _KERNELS:  # (no compiler here: no builder can store it either)
        stored = device.type == "cpu" and unavailable_reason() is None
        _KERNELS[key] = aot.load_or_remember(fn, args, constants) if stored else None
    return _KERNELS[key]


def jit_kernel(fn, args, constants: dict):
    """fn compiled by inductor in this process (its FX graph cache spares the code generation of a kernel
    built before). Rounding as in eager mode: each explicit cast to bf16 rounds there
    (emulate_precision_casts), so a compiled chain of ops gives the eager chain's bits where the sums
    run in the same order."""
    import torch._inductor  # the compiler, imported only by the process that needs it
    from torch.fx.experimental.proxy_tensor import make_fx

    # contiguous, like every call's; never written, so the lm_head's 311 MB are never touched
    examples = [torch.empty(a.shape, dtype=a.dtype, device=a.device) for a in args]
    # traced on fake tensors: a real trace would compute W.float() * x, (N, K) floats
    graph = make_fx(lambda *tensors: fn(*tensors, **constants), tracing_mode="fake")(*examples)
    with cacheable():
        return torch._inductor.compile(graph, examples, options=inductor_options(fn))


def inductor_options(fn) -> dict:
    """The inductor config fn is compiled with, here and by the ahead-of-time builder (aot_build.py):
    aot.INDUCTOR_OPTIONS (eager's bf16 roundings, the CPU's vector instructions without a test build of each),
    and whatever the function asks for (its `inductor_config`; cpu_decode.py's whole-half kernels ask to store
    every intermediate buffer)."""
    return {**aot.INDUCTOR_OPTIONS, **getattr(fn, "inductor_config", {})}


def cacheable():
    """A tracing context whose fake-tensor mode has a (static) ShapeEnv: without one, inductor's FX graph
    cache bypasses a graph handed to it directly ("No shape env") and generates its code again in every
    process. With it, a later process loads each kernel's code from inductor's on-disk cache (keyed by the
    graph, torch's version, the inductor config and the CPU): the second start of `qwen3-generate` on the
    0.6B shapes spent ~4.5 s less in inductor (docs/performance.md, cold start)."""
    from torch._guards import TracingContext, tracing
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    return tracing(TracingContext(FakeTensorMode(shape_env=ShapeEnv())))


@functools.cache
def unavailable_reason() -> str | None:
    """None if inductor can build CPU kernels here; otherwise why not (no C++ compiler, ...)."""
    try:
        x, w = torch.ones(1, 16), torch.ones(16, 16)  # fp32 x, as every call passes it
        if not torch.equal(kernel(matvec, x, w)(x, w), torch.full((16,), 16.0)):
            return "the compiled product gave a wrong answer"
    except Exception as error:  # any failure of the toolchain means: use the eager kernels
        return aot.failure(error)
    return None


def one_row(x: torch.Tensor, in_features: int) -> bool:
    """True when x holds a single activation row on the CPU: batch-1 decode."""
    return x.device.type == "cpu" and x.numel() == in_features


class MatvecLinear(nn.Module):
    """nn.Linear whose one-row products run the compiled loop; longer inputs (prefill) use F.linear, or in fp32
    where the CPU has no bf16 instructions (widen.py).

    It keeps the same weight tensor (a view of the mapped checkpoint, or the embedding for a tied
    lm_head): no copy, no new layout, so the model's memory is the checkpoint's.
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.split_sizes = getattr(linear, "split_sizes", None)

    @property
    def kernel(self):
        """The compiled loop for this shape, obtained at its first use: a decode layer's products run inside
        its two whole-half kernels (cpu_decode.py), so most matrices never need one of their own."""
        compiled = self.__dict__.get("_kernel")
        if compiled is None:
            compiled = self.__dict__["_kernel"] = kernel(matvec, torch.empty(1, self.in_features), self.weight,
                                                         rows=slice_rows(self.out_features))  # fmt: skip
        return compiled

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not one_row(x, self.in_features):
            return widen.product(x, self.weight, self.bias)
        # under torch.compile the same maths is traced into the caller's graph instead
        row = x.reshape(1, self.in_features).float().contiguous()
        y = matvec(row, self.weight) if torch.compiler.is_compiling() else self.kernel(row, self.weight)  # (N,)
        y = y.view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


def can_use_matvec(model: Qwen3) -> bool:
    """A CPU model in a float dtype, and an inductor that builds kernels here (warns once if not)."""
    weight = model.model.embed_tokens.weight
    if weight.device.type != "cpu" or weight.dtype not in SUPPORTED_DTYPES:
        return False
    reason = unavailable_reason()
    if reason is not None:
        warnings.warn(f"compiled CPU decode kernels are unavailable ({reason}); using oneDNN's", stacklevel=2)
    return reason is None


@torch.no_grad()
def use_matvec(model: Qwen3) -> Qwen3:
    """Every float nn.Linear (projections, lm_head; not a MoE block's router) becomes a MatvecLinear."""
    return replace_linears(model, MatvecLinear)
