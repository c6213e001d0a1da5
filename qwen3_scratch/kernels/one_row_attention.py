"""One row's decode attention on a CPU as one stored kernel, reading the cache where it lies.

A batch-1 decode step attends one query per head over the S slots written so far. Done with torch's ops, that
is ~10 small calls a layer around very little arithmetic (0.3 MFLOP at 64 slots): a widening copy of the keys
and values to fp32 and SDPA's fp32 kernel (cpu_decode.attend_in_fp32, up to 256 slots in half precision), or
two small oneDNN products and a softmax (the model's one_query_attention, past that; SDPA's kernel in fp32).
Here the same attention is written as plain ops,

    scores[k, g, s] = sum_d float(q[k, g, d]) * float(keys[k, s, d]) / sqrt(D)     (the G = H/K heads of kv head k)
    y[k, g, d] = sum_s softmax(scores[k, g])[s] * float(values[k, s, d])

and compiled by inductor into C++ loops that read the bf16 cache in place and widen as they read: no copy of
the cache, no mask turned into a tensor of its own, one call a layer. The attended length S changes every 64
tokens and the cache's length with every prompt, so the kernel is stored (kernels/aot.py) as one AOTInductor
package for any S and cache length, checked bit for bit against torch.compile's kernel for any size, which is
what a process without the package runs (and hands to the builder at its exit): the tokens never depend on
which of the two a start found.

Measured (one layer of the 0.6B shapes: 16 query and 8 kv heads, D 128; AMD EPYC Zen 4, 2 threads; the package
against what a decode step ran before; docs/performance.md, "One row's attention as one stored kernel"):

    slots                        32     80    160    256    512   1024   2048
    bf16: before, us             62     73     93    220    384    671   1655
    bf16: this kernel, us        14     24     37     73    107    205    406
    fp32: SDPA (before), us             46            94           297
    fp32: this kernel, us               19            50           163

A decode at the 0.6B shapes, 64 tokens: bf16 +4%, int4 weights +7% after a 16-token prompt; bf16 +25% after a
1500-token one. The part of a step that is not a weight read: bf16 6.0-7.4 -> 2.8-5.1 ms, int4 8.3-8.8 -> 3.9-4.1.

The maths is fp32 throughout (as attend_in_fp32's, not the eager layers' bf16 scores), so bf16 outputs are held
to the parity suite's bf16 bounds and fp32 ones to fp32 rounding (tests/test_one_row_attention.py). With stored
kernels off (QWEN3_SCRATCH_AOT=0, the test suite), or where the compiler cannot build it, decode attends as before.

Shapes: H query heads, K kv heads, G = H/K, D head_dim, L the cache's slots, S the slots attended.
"""

import functools
import warnings

import torch

from . import aot


def one_row_attention(q, keys, values, mask):
    """q (1, H, 1, D) over the first S slots of one layer's cache -> (1, 1, H*D) in q's dtype.

    keys, values (1, K, L, D): the layer's whole cache, S <= L; mask (1, 1, 1, S) bool: which of those slots the
    token attends (True), at least one."""
    _, H, _, D = q.shape
    K, S, dtype = keys.shape[1], mask.shape[-1], q.dtype
    q = q.reshape(K, H // K, 1, D).float()  # (K, G, 1, D): the G heads that share a kv head
    k, v = keys[0, :, None, :S].float(), values[0, :, None, :S].float()  # (K, 1, S, D), widened as read
    scores = (q * k).sum(-1) * D**-0.5  # (K, G, S)
    scores = scores.masked_fill(~mask.view(1, 1, S), float("-inf"))
    probs = torch.softmax(scores, dim=-1)  # fp32
    y = (probs[..., None] * v).sum(2)  # (K, G, D)
    return y.to(dtype).reshape(1, 1, H * D)


# The package: one for any cache length (L) and attended slots (S). Exported at the first sizes, with both
# symbolic; checked bit for bit against the compiled kernel at each (the whole cache attended, one slot, a long one).
PACKAGE_SIZES = [dict(L=100, S=64), dict(L=64, S=64), dict(L=5, S=1), dict(L=1200, S=1088)]


def attend(attn, q, k, v, mask, cache, cache_slots):
    """Attention.attend for one token of one row, by the kernel: k, v (1, K, 1, D) written to the cache first."""
    keys, values = cache.update(attn.layer_index, k, v, cache_slots)  # (1, K, L, D)
    run = kernel(q.dtype, keys.dtype, keys.shape[1], q.shape[1], q.shape[3])
    return run(q.contiguous(), keys, values, mask.contiguous())


def available(attn, q) -> bool:
    """True where this layer's decode step attends by the kernel: stored kernels on (a CLI's, a server's; not the
    test suite's), and the kernel stored or built for its heads and dtype."""
    return aot.enabled() and kernel(q.dtype, q.dtype, attn.n_kv_heads, attn.n_heads, attn.head_dim) is not None


@functools.cache
def kernel(q_dtype, cache_dtype, K: int, H: int, D: int):
    """The stored package for these dtypes and heads, loaded without the compiler, else torch.compile's kernel for
    any size (then the package is built when the command exits: kernels/aot_build.py), else None: the compiler
    failed to build it or built a wrong one, and decode attends as without stored kernels (warned once)."""
    stored = stored_kernel(q_dtype, cache_dtype, K, H, D)
    if stored is not None:
        return stored
    reason = unavailable_reason(q_dtype, cache_dtype, K, H, D)
    if reason is not None:
        warnings.warn(f"one-row decode attention is unavailable ({reason}); attending by torch's ops", stacklevel=2)
        return None
    return compiled


@torch.no_grad()
def unavailable_reason(q_dtype, cache_dtype, K: int, H: int, D: int) -> str | None:
    """None if torch.compile builds the kernel for these heads and dtypes and it gives the plain ops' answer (this
    is the build a first start pays anyway, at load); else why not."""
    shapes = [[1, H, 1, D], [1, K, 5, D], [1, K, 5, D], [1, 1, 1, 3]]
    args = package_examples(shapes, [q_dtype, cache_dtype, cache_dtype, torch.bool], seed=0)
    try:
        got = compiled(*args)
    except Exception as error:  # any failure of the toolchain means: torch's ops instead
        return aot.failure(error)
    if not torch.allclose(got.float(), one_row_attention(*args).float(), rtol=1e-2, atol=1e-2):
        return "the compiled kernel gave a wrong answer"
    return None


def stored_kernel(q_dtype, cache_dtype, K: int, H: int, D: int):
    """The package an earlier process stored for these dtypes and heads (~2 ms to load), or None: then it is named
    to the builder for the command's exit (kernels/aot.py)."""
    shapes = [[1, H, 1, D], [1, K, "L", D], [1, K, "L", D], [1, 1, 1, "S"]]
    dtypes = (q_dtype, cache_dtype, cache_dtype, torch.bool)
    args = [torch.empty(0, dtype=dtype) for dtype in dtypes]  # the key reads their dtypes; the sizes are named
    dynamic = {"shapes": shapes, "examples": f"{__name__}:package_examples", "reference": f"{__name__}:compiled",
               "sizes": PACKAGE_SIZES, "inductor": dict(aot.INDUCTOR_OPTIONS)}  # fmt: skip
    return aot.load_or_remember(one_row_attention, args, {}, dynamic)


def package_examples(shapes: list, dtypes: list, seed: int) -> list[torch.Tensor]:
    """Inputs of the given shapes for the package's check: random queries and cache, about one slot in five masked
    (the first kept)."""
    g = torch.Generator().manual_seed(seed)
    q, keys, values = (torch.randn(shape, generator=g).to(dtype) for shape, dtype in zip(shapes[:3], dtypes[:3]))
    mask = torch.rand(shapes[3], generator=g) < 0.8
    mask[..., 0] = True
    return [q, keys, values, mask]


@functools.cache
def _compiled():
    """torch.compile's kernel for any size (made at the first call: torch.compile imports dynamo)."""
    return torch.compile(one_row_attention, dynamic=False, fullgraph=True, options=dict(aot.INDUCTOR_OPTIONS))


def compiled(q, keys, values, mask):
    """one_row_attention by torch.compile, for any L and S: what a process without the package runs, and what the
    builder checks the package against."""
    mark = torch._dynamo.decorators.mark_unbacked  # no guard on L's or S's value: one compile for every step
    for tensor, dim in ((keys, 2), (values, 2), (mask, 3)):
        mark(tensor, dim)
    try:
        return _compiled()(q, keys, values, mask)
    except torch._dynamo.exc.FailOnRecompileLimitHit:
        # each (dtype, heads) is a compile; a process that has decoded that many head shapes (a test session
        # does) runs the same maths eagerly rather than fail
        _warn_once("one-row attention: dynamo's recompile limit reached; this head shape runs uncompiled")
        return one_row_attention(q, keys, values, mask)


@functools.cache
def _warn_once(message: str) -> None:
    warnings.warn(message, stacklevel=3)
