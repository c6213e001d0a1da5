"""Decode attention that reads keys and values where they lie in the paged pool: no gather.

A decode batch has one new token per row, each attending over its own blocks of the pool. The
gather path (paged_cache.PagedView) copies every row's blocks into a dense tensor first, every layer
of every step, and attention then reads the copy: at 16 rows x 512 tokens that copy cost more than
the attention itself (docs/performance.md, "Serving"). Here the same attention is written as plain
PyTorch ops over the pool indexed by the block tables,

    scores[k, b, g, w, i] = sum_d q[k, b, g, d] * pool_k[k, tables[b, w], i, d]   (b's w-th block, slot i)

and compiled by inductor (torch.compile) into C++ loops that load each key and value row straight
from its block: an indexing that feeds a reduction is fused into it, so `pool[:, tables]` is never
made. The batch B and the block tables' width W change every step, the pool's size and block size
with each engine; they are marked unbacked (symbolic, with no guard on their values), so one compile
per dtype and head shape serves every step and every engine. On a GPU the same code would compile to
Triton; it has not been measured there, so only the CPU uses it (`supported`); the GPU keeps the gather.

That compile costs a process ~5 s at its first decode step (dynamo's and inductor's imports, the trace, the
build): a server's first request waited for it on every start. So the kernel is also kept as one AOTInductor
package per dtype and head shape, exported with the same four sizes symbolic (kernels/aot.py, aot_build.py;
`qwen3-serve` hands it to the builder when it exits) and checked bit for bit against the compiled kernel. A later
process loads it in ~2 ms and imports no compiler: the first request of a second start (0.6B shapes, bf16, two
prompts, 16 tokens) 6.8 -> 1.6 s, and without dynamo's guards a one-row engine step 87 -> 82 ms (AMD EPYC).

The maths is one_query_attention's (model/qwen3.py) in transformers' eager order: scores in the
activations' dtype, masked, softmax in fp32, cast back, times v; each sum in fp32. fp32 outputs equal
the gather path's within float rounding; bf16 rounds where eager rounds (emulate_precision_casts).
tests/test_paged_attention.py checks it against the gather path and the engine against the simple loop.

Measured (scripts/bench/profile_serving_step.py and one layer alone; 0.6B shapes: K=8 kv heads, D=128, 16
rows x 513 keys, blocks of 16, pages scattered through the pool; AMD EPYC Zen 4, 2 threads), one layer:
  bf16: contiguous one_query_attention 3.1 ms, gather + it 10.5 ms, in place 4.3 ms, FlexAttention 12.2 ms
  fp32: contiguous SDPA 5.7 ms, gather + it 36.7 ms, in place 4.5 ms, FlexAttention 6.0 ms
FlexAttention ran over the same pool expanded over the batch, with a BlockMask built from the tables
(BlockMask.from_kv_blocks); its CPU decoding template runs one query head and one 16-key block per
micro-kernel call. A whole bf16 decode step at 16 x 512: in place 1.05-1.10x the contiguous step,
gathering 3.6-5.0x, in the same runs (docs/performance.md, "Paged attention in place").

Shapes: B rows, H query heads, K kv heads, G = H/K, D head_dim, NB pool blocks, bs block_size,
W blocks per row (the widest row's; narrower rows are padded and masked).
"""

import functools
import warnings

import torch

from qwen3_scratch.kernels import aot
from qwen3_scratch.model.config import Qwen3Config


def paged_decode_attention(q, key_blocks, value_blocks, tables, valid):
    """q (B, H, 1, D) over each row's blocks of one layer's pool -> (B, H, 1, D).

    key_blocks, value_blocks (K, NB, bs, D): the pool seen as blocks; tables (B, W) block ids per row;
    valid (B, W, bs) bool: which of those slots the row attends (its keys, not the padding).
    """
    B, H, _, D = q.shape
    K = key_blocks.shape[0]
    q = q.reshape(B, K, H // K, D).transpose(0, 1)  # (K, B, G, D): the G heads that share a kv head
    keys, values = key_blocks[:, tables], value_blocks[:, tables]  # (K, B, W, bs, D), fused, never made
    scores = (q[:, :, :, None, None, :].float() * keys[:, :, None].float()).sum(-1)  # (K, B, G, W, bs)
    scores = scores.to(q.dtype) * D**-0.5
    scores = scores.masked_fill(~valid[None, :, None], float("-inf"))
    _, _, G, W, bs = scores.shape
    probs = torch.softmax(scores.reshape(K, B, G, W * bs), dim=-1, dtype=torch.float32).to(q.dtype)
    probs = probs.reshape(K, B, G, W, bs, 1)
    y = (probs.float() * values[:, :, None].float()).sum((3, 4)).to(q.dtype)  # (K, B, G, D)
    return y.transpose(0, 1).reshape(B, H, 1, D)


@functools.cache
def _compiled():
    """One compiled function for the process: its guards are on the dtype and the static sizes (K, G, D).
    Made at the first call, not at import: torch.compile imports dynamo (~1 s of a server's start)."""
    return torch.compile(paged_decode_attention, dynamic=False, fullgraph=True, options=INDUCTOR_OPTIONS)


# kernels/aot.py's options, and no bounds check of each table entry: the tables are built valid
INDUCTOR_OPTIONS = {**aot.INDUCTOR_OPTIONS, "assert_indirect_indexing": False}


def attend_in_place(q, key_blocks, value_blocks, tables, valid):
    """paged_decode_attention, compiled: the package an earlier process stored for these heads and dtypes, else
    torch.compile's kernel (and the package is built when the command exits: kernels/aot_build.py).

    q and the tables arrive as views whose strides change with the step (a decode row's stride is the step's
    token count; the tables are a slice of a wider table). Strides are guarded on, so each new layout would
    compile again (seconds on a CPU, at a server's first requests): both are made contiguous first, a copy of a
    few hundred bytes, and the one compile serves every step."""
    args = (q.contiguous(), key_blocks, value_blocks, tables.contiguous(), valid)
    H, D, K = q.shape[1], q.shape[3], key_blocks.shape[0]
    stored = stored_kernel(q.dtype, key_blocks.dtype, tables.dtype, valid.dtype, H, D, K)
    return stored(*args) if stored is not None else attend_compiled(*args)


# The package: one for any rows (B), table width (W), pool blocks (NB) and block size (bs). Built from the first
# sizes (exported with those four symbolic), checked bit for bit against attend_compiled at each.
PACKAGE_SIZES = [dict(B=3, W=5, NB=10, bs=4), dict(B=16, W=33, NB=200, bs=16), dict(B=1, W=1, NB=7, bs=16),
                 dict(B=2, W=1, NB=3, bs=1)]  # fmt: skip


@functools.cache
def stored_kernel(q_dtype, pool_dtype, table_dtype, valid_dtype, H: int, D: int, K: int):
    """The stored package for these dtypes and heads, loaded without the compiler (~2 ms), or None: the process
    then compiles the kernel, and hands it to the builder for later starts (kernels/aot.py)."""
    shapes = [["B", H, 1, D], [K, "NB", "bs", D], [K, "NB", "bs", D], ["B", "W"], ["B", "W", "bs"]]
    dtypes = (q_dtype, pool_dtype, pool_dtype, table_dtype, valid_dtype)
    args = [torch.empty(0, dtype=dtype) for dtype in dtypes]  # the key reads their dtypes; the sizes are named
    dynamic = {"shapes": shapes, "examples": f"{__name__}:package_examples", "reference": f"{__name__}:attend_compiled",
               "sizes": PACKAGE_SIZES, "inductor": dict(INDUCTOR_OPTIONS)}  # fmt: skip
    return aot.load_or_remember(paged_decode_attention, args, {}, dynamic)


def package_examples(shapes: list, dtypes: list, seed: int) -> list[torch.Tensor]:
    """Inputs of the given shapes for the package's check: random queries and pool, tables of valid block ids,
    about one slot in five masked (each row keeps its first)."""
    g = torch.Generator().manual_seed(seed)
    (B, H, _, D), (K, NB, bs, _) = shapes[0], shapes[1]
    W = shapes[3][1]
    q = torch.randn(B, H, 1, D, generator=g).to(dtypes[0])
    key_blocks, value_blocks = (torch.randn(K, NB, bs, D, generator=g).to(dtypes[1]) for _ in range(2))
    tables = torch.randint(0, NB, (B, W), generator=g, dtype=dtypes[3])
    valid = torch.rand(B, W, bs, generator=g) < 0.8
    valid[:, 0, 0] = True
    return [q, key_blocks, value_blocks, tables, valid]


def attend_compiled(q, key_blocks, value_blocks, tables, valid):
    """paged_decode_attention by torch.compile; the sizes that change between calls are marked unbacked."""
    mark = torch._dynamo.decorators.mark_unbacked
    for tensor, dims in ((q, (0,)), (tables, (0, 1)), (valid, (0, 1, 2)), (key_blocks, (1, 2)), (value_blocks, (1, 2))):
        for dim in dims:  # B; B, W; B, W, bs; NB, bs
            mark(tensor, dim)
    try:
        return _compiled()(q, key_blocks, value_blocks, tables, valid)
    except torch._dynamo.exc.FailOnRecompileLimitHit:
        # Each (dtype, K, G, D) is a compile, and dynamo stops at its recompile limit (8): a process that has
        # served that many head shapes (a test session does) runs the same maths eagerly rather than fail.
        _warn_once("paged attention: dynamo's recompile limit reached; this head shape runs uncompiled")
        return paged_decode_attention(q, key_blocks, value_blocks, tables, valid)


@functools.cache
def _warn_once(message: str) -> None:
    warnings.warn(message, stacklevel=3)


def supported(config: Qwen3Config, device, dtype) -> bool:
    """True where the in-place kernel runs: a CPU whose inductor builds it (else the gather, warned once)."""
    if torch.device(device or "cpu").type != "cpu":
        return False
    reason = unavailable_reason(config.num_attention_heads, config.num_key_value_heads, config.head_dim, dtype)
    if reason is not None:
        warnings.warn(f"in-place paged attention is unavailable ({reason}); gathering the blocks instead", stacklevel=2)
    return reason is None


@functools.cache
@torch.no_grad()  # as the runner calls it: grad mode is one of the compiled graph's guards
def unavailable_reason(H: int, K: int, D: int, dtype: torch.dtype) -> str | None:
    """None if the kernel builds for these heads and dtype and equals the plain maths; else why not.

    This builds the kernel (seconds): the pool asks at its warm-up or first decode step, never at its
    start (paged_cache.PagedKVCache.in_place), and every later step reuses the build."""
    g = torch.Generator().manual_seed(0)
    key_blocks, value_blocks = (torch.randn(K, 3, 4, D, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(2, H, 1, D, generator=g).to(dtype)
    tables, valid = torch.tensor([[2, 0], [1, 1]]), torch.ones(2, 2, 4, dtype=torch.bool)
    valid[1, 1] = False  # row 1 has one block, padded
    try:
        got = attend_in_place(q, key_blocks, value_blocks, tables, valid)
    except Exception as error:  # any failure of the toolchain means: gather instead
        return aot.failure(error)
    expected = paged_decode_attention(q, key_blocks, value_blocks, tables, valid)
    if not torch.allclose(got.float(), expected.float(), rtol=1e-2, atol=1e-2):
        return "the compiled kernel gave a wrong answer"
    return None
