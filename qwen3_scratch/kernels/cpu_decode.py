"""A decoder layer's batch-1 decode step on a CPU, in two kernel calls and its attention instead of ~60 ops.

Once the matrix-vector products stream weights near the memory bandwidth (matvec.py), what is left
of a decode step is everything between them: two RMSNorms, the q/k norms, RoPE, two residual adds
and the SwiGLU gate are ~45 eager ops a layer on vectors of 1024 numbers, each a few microseconds of
dispatch. Here each half of a layer around its cache is one compiled graph (matvec.kernel: inductor,
no guards; packaged ahead of time for later starts, aot.py), products included:

    [norm -> q/k/v products -> q/k norm + RoPE] -> cache + attention (the model's own, or below)
    -> [o product -> residual + norm -> gate/up products -> SwiGLU -> down product + residual]

Inductor is told to store each product's input row (STORE_PRODUCT_INPUTS; int8 codes: STORE_EVERY_BUFFER):
left to itself it recomputes a norm's pointwise tail inside every weight row's loop of the products
that read it (2x slower). So each product is matvec's own loop, and the layer's ~11 calls and ~18
views become 2 calls. Bf16 decode at the 0.6B shapes, Intel Xeon with AMX, 2 threads: a step 125 ->
94 ms, then 94 -> 84 with matvec.row_sums' unrollable runs (docs/performance.md, "Two kernels a layer").
int8 layers run the same two halves over their int8 products, int4 layers over torch's int4 kernel
(called from inside the graph). Any other layer (tensor-parallel, a mixture of experts, the "batch"
layout's fused float matrices) runs the same ops as four smaller kernels around its separate products.

The maths is the model's: the kernels trace model.rms_norm, rope.apply_rope and F.silu in the same
order and dtypes, with eager's roundings to bf16. One exception, for speed: attention. With stored kernels
on (every CLI and server), it is one_row_attention.py's kernel, one call a layer over the cache in place, in
fp32 (2-4x faster a layer than the routes below, at any length; not on a CPU with AMX in half precision,
which keeps the flash kernel). With them off (the test suite): in bf16 (or fp16), while the context is
short (at most SHORT_CONTEXT slots attended), attention runs in fp32 over the cache widened for the step
(`attend_in_fp32`, by SDPA's fp32 kernel): oneDNN's half-precision batched products for one query cost ~2x
the fp32 ones at these sizes, more than widening (1, K, S, D) keys and values costs
(docs/performance-history.md).
On a CPU with AMX (Intel Sapphire Rapids and later) half-precision attention is instead one call of
SDPA's flash kernel on the cache as it is (`attend_flash`: 3.9 against 6.5 ms a step on the Intel Xeon).
None is bit-identical to the eager layers (their scores are not rounded to bf16): each is held
to the parity suite's bf16 bounds (16 greedy tokens as transformers'); with all three off, bf16 logits are
bit-identical to the eager layers' (tests/test_decode_layouts.py). Everything that is not a batch-1
decode step on a CPU (prefill, batches, the GPU) runs DecoderLayer.forward unchanged.

The first version (six kernels around separate products) bought +5% (bf16 15.03 -> 15.72 tok/s on the
AMD EPYC) and int8 +6%; the whole halves buy more because the products themselves stream faster
together (docs/performance.md).

Shapes: C hidden_size, H query heads, K kv heads, D head_dim, F intermediate_size.
"""

import torch
import torch.nn.functional as F
from torch import nn

from qwen3_scratch.model.kv_cache import KVCache, attention_mask
from qwen3_scratch.model.qwen3 import MLP, DecoderLayer, Qwen3, rms_norm
from qwen3_scratch.model.rope import apply_rope

from . import one_row_attention
from .int4 import FUSED_MULTIPLY_ADD, NEVER_STORE, Int4Linear, matvec_int4_words
from .int4_pairs import Int4PairsLinear, matvec_int4_pairs
from .matvec import INT8_WORDS_STREAMS, MatvecLinear, kernel, matvec, matvec_int8, matvec_int8_words, slice_rows
from .quantize import Int8Linear

SCALES = ("scales", "scales_and_zeros")  # what an int8 (Int8Linear) or int4 (Int4Linear) product reads beside its weight


def heads(q, k, v, q_weight, k_weight, cos, sin, *, n_heads: int, n_kv_heads: int, head_dim: int, eps: float):
    """Attention.forward's steps between the projections and the cache, for one token of one row:
    q (1, 1, H*D), k, v (1, 1, K*D) -> per-head, normed, rotated q (1, H, 1, D), k, v (1, K, 1, D)."""
    q = rms_norm(q.view(1, 1, n_heads, head_dim), q_weight, eps).transpose(1, 2)  # (1, H, 1, D)
    k = rms_norm(k.view(1, 1, n_kv_heads, head_dim), k_weight, eps).transpose(1, 2)  # (1, K, 1, D)
    v = v.view(1, 1, n_kv_heads, head_dim).transpose(1, 2)  # (1, K, 1, D)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def norm(x, weight, *, eps: float, wide: bool):
    """The layer's first norm, (1, 1, C); widened to fp32 for compiled products (see `widen`)."""
    return widen(rms_norm(x, weight, eps), wide)


def residual_norm(x, y, weight, *, eps: float, wide: bool):
    """The residual add and the next norm: x + y and rms_norm(x + y), (1, 1, C) each (the norm widened
    for compiled products)."""
    x = x + y
    return x, widen(rms_norm(x, weight, eps), wide)


def widen(h, wide: bool):
    """h in fp32 where the next products are compiled loops (matvec.py), which take their input row in fp32:
    widening here, inside the kernel that made h, spares a separate cast for each product that reads it
    (q, k, v; gate, up; down: six a layer). Exact: the bf16 rounding of h happens first, as in eager."""
    return h.float() if wide else h


def product(h, weight, scales=None, *, rows=None):
    """One product inside a whole-half kernel: h (1, K) -> (N,). matvec's loop (h fp32; in slices of `rows` rows,
    matvec.slice_rows, where the products of one row are cut into slices summed at once), int8's (h fp32, the
    row scales given; the codes int8, or as float32 words, Int8Linear.codes), torch's int4 kernel (h in the
    activations' dtype, the packed nibbles and their scales_and_zeros (K/g, N, 2) given: the group size g
    follows from the shapes), int4's words loop (h fp32, the words (N/8, K/8, 8) as Int4Linear.codes), or the
    pairs' (h fp32, the words (N/16, K/32, 8, 8): int4_pairs.py)."""
    if weight.dtype == torch.uint8:  # int4.Int4Linear's packed codes: an extern call inside the kernel
        group_size = h.shape[-1] // scales.shape[0]
        return torch._weight_int4pack_mm_for_cpu(h, weight, group_size, scales).view(-1)
    if weight.dim() == 3:  # int4.Int4Linear's words
        return matvec_int4_words(h, weight, scales)
    if weight.dim() == 4:  # int4_pairs.Int4PairsLinear's pairs
        return matvec_int4_pairs(h, weight, scales)
    if scales is None:
        return matvec(h, weight, rows)
    if weight.dtype == torch.int8:
        return matvec_int8(h, weight, scales)
    return matvec_int8_words(h, weight, scales, slice_rows(weight.shape[0], streams=INT8_WORDS_STREAMS))


def first_half(x, norm_weight, projections, q_norm_weight, k_norm_weight, cos, sin, *, n_heads, n_kv_heads, head_dim, eps,
               wide=True):  # fmt: skip
    """norm -> q/k/v products -> q/k norm + RoPE. projections: q's, k's and v's (weight,) or (weight, scales),
    or one fused q/k/v product's. wide: the products take fp32 rows (compiled loops), else the activations'
    dtype (torch's int4 kernel)."""
    h = norm(x, norm_weight, eps=eps, wide=wide).view(1, -1)  # (1, C)
    if len(projections) == 1:  # q/k/v fused (fuse.py): one product, rows split
        q, k, v = product(h, *projections[0]).split([n_heads * head_dim, n_kv_heads * head_dim, n_kv_heads * head_dim])
    else:
        rows = slice_rows(*(weights[0].shape[0] for weights in projections))  # q's, k's and v's slices in one loop
        q, k, v = (product(h, *weights, rows=rows) for weights in projections)
    q, k, v = (t.contiguous().view(1, 1, -1) for t in (q, k, v))
    return heads(q, k, v, q_norm_weight, k_norm_weight, cos, sin, n_heads=n_heads, n_kv_heads=n_kv_heads,
                 head_dim=head_dim, eps=eps)  # fmt: skip


def second_half(x, y, o, norm_weight, gate_up, down, *, eps: float, wide=True):
    """o product -> residual + norm -> gate/up products -> SwiGLU -> down product + residual. gate_up: gate's
    and up's (weight,) or (weight, scales), or one fused gate/up product's. wide: as first_half's."""
    o_rows, down_rows = slice_rows(o[0].shape[0]), slice_rows(down[0].shape[0])
    y = product(widen(y.view(1, -1), wide), *o, rows=o_rows).view(x.shape)
    x, h = residual_norm(x, y, norm_weight, eps=eps, wide=wide)
    h = h.view(1, -1)  # (1, C)
    if len(gate_up) == 1:  # gate/up fused (fuse.py): one product, rows split in half
        gate, up = product(h, *gate_up[0]).chunk(2)
    else:
        rows = slice_rows(*(weights[0].shape[0] for weights in gate_up))  # gate's and up's slices in one loop
        gate, up = (product(h, *weights, rows=rows) for weights in gate_up)
    h = swiglu(gate.contiguous(), up.contiguous(), wide=wide)  # (F,)
    return (x.view(-1) + product(h.view(1, -1), *down, rows=down_rows)).view(x.shape)  # rounded, then added: as eager


def attention_inputs(x, norm_weight, q_weight, k_weight, v_weight, q_norm_weight, k_norm_weight, cos, sin, *,
                     n_heads: int, n_kv_heads: int, head_dim: int, eps: float):
    """A layer's first half up to its cache, as one kernel: x (1, 1, C) -> q (1, H, 1, D), k, v (1, K, 1, D)."""
    return first_half(x, norm_weight, [(q_weight,), (k_weight,), (v_weight,)], q_norm_weight, k_norm_weight, cos, sin,
                      n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim, eps=eps)  # fmt: skip


def attention_output_and_mlp(x, y, o_weight, norm_weight, gate_weight, up_weight, down_weight, *, eps: float):
    """A layer's second half, as one kernel: x (1, 1, C) the layer's input, y (1, 1, H*D) attention's output
    -> the layer's output (1, 1, C)."""
    return second_half(x, y, (o_weight,), norm_weight, [(gate_weight,), (up_weight,)], (down_weight,), eps=eps)


def attention_inputs_int8(x, norm_weight, qkv_weight, qkv_scales, q_norm_weight, k_norm_weight, cos, sin, *,
                          n_heads: int, n_kv_heads: int, head_dim: int, eps: float):  # fmt: skip
    """attention_inputs over one fused int8 q/k/v product (quantize.Int8Linear: weight and row scales)."""
    return first_half(x, norm_weight, [(qkv_weight, qkv_scales)], q_norm_weight, k_norm_weight, cos, sin,
                      n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim, eps=eps)  # fmt: skip


def attention_output_and_mlp_int8(x, y, o_weight, o_scales, norm_weight, gate_up_weight, gate_up_scales,
                                  down_weight, down_scales, *, eps: float):  # fmt: skip
    """attention_output_and_mlp over int8 products, gate/up fused."""
    return second_half(x, y, (o_weight, o_scales), norm_weight, [(gate_up_weight, gate_up_scales)],
                       (down_weight, down_scales), eps=eps)  # fmt: skip


def attention_inputs_int8_words(*args, **shape):
    """attention_inputs_int8 over codes read four to a word (a CPU with AVX2 only, matvec.matvec_int8_words): a
    kernel of its own, for its inductor config (below)."""
    return attention_inputs_int8(*args, **shape)


def attention_output_and_mlp_int8_words(*args, eps: float):
    """attention_output_and_mlp_int8 over codes read four to a word."""
    return attention_output_and_mlp_int8(*args, eps=eps)


def attention_inputs_int4(x, norm_weight, qkv_weight, qkv_scales_and_zeros, q_norm_weight, k_norm_weight, cos, sin, *,
                          n_heads: int, n_kv_heads: int, head_dim: int, eps: float):  # fmt: skip
    """attention_inputs over one fused int4 q/k/v product (int4.Int4Linear: packed codes, scales and zeros), its
    row in the activations' dtype."""
    return first_half(x, norm_weight, [(qkv_weight, qkv_scales_and_zeros)], q_norm_weight, k_norm_weight, cos, sin,
                      n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim, eps=eps, wide=False)  # fmt: skip


def attention_output_and_mlp_int4(x, y, o_weight, o_scales_and_zeros, norm_weight, gate_up_weight,
                                  gate_up_scales_and_zeros, down_weight, down_scales_and_zeros, *, eps: float):  # fmt: skip
    """attention_output_and_mlp over int4 products, gate/up fused."""
    return second_half(x, y, (o_weight, o_scales_and_zeros), norm_weight,
                       [(gate_up_weight, gate_up_scales_and_zeros)], (down_weight, down_scales_and_zeros), eps=eps,
                       wide=False)  # fmt: skip


def attention_inputs_int4_words(x, norm_weight, qkv_weight, qkv_scales_and_zeros, q_norm_weight, k_norm_weight, cos,
                                sin, *, n_heads: int, n_kv_heads: int, head_dim: int, eps: float):  # fmt: skip
    """attention_inputs over one fused int4 q/k/v product in the words layout (int4.matvec_int4_words)."""
    return first_half(x, norm_weight, [(qkv_weight, qkv_scales_and_zeros)], q_norm_weight, k_norm_weight, cos, sin,
                      n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim, eps=eps)  # fmt: skip


def attention_output_and_mlp_int4_words(x, y, o_weight, o_scales_and_zeros, norm_weight, gate_up_weight,
                                        gate_up_scales_and_zeros, down_weight, down_scales_and_zeros, *,
                                        eps: float):  # fmt: skip
    """attention_output_and_mlp over int4 products in the words layout, gate/up fused."""
    return second_half(x, y, (o_weight, o_scales_and_zeros), norm_weight, [(gate_up_weight, gate_up_scales_and_zeros)],
                       (down_weight, down_scales_and_zeros), eps=eps)  # fmt: skip


def attention_inputs_int4_pairs(x, norm_weight, qkv_weight, qkv_scales_and_zeros, q_norm_weight, k_norm_weight, cos,
                                sin, *, n_heads: int, n_kv_heads: int, head_dim: int, eps: float):  # fmt: skip
    """attention_inputs over one fused int4 q/k/v product in the pairs layout (int4_pairs.matvec_int4_pairs)."""
    return first_half(x, norm_weight, [(qkv_weight, qkv_scales_and_zeros)], q_norm_weight, k_norm_weight, cos, sin,
                      n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim, eps=eps)  # fmt: skip


def attention_output_and_mlp_int4_pairs(x, y, o_weight, o_scales_and_zeros, norm_weight, gate_up_weight,
                                        gate_up_scales_and_zeros, down_weight, down_scales_and_zeros, *,
                                        eps: float):  # fmt: skip
    """attention_output_and_mlp over int4 products in the pairs layout, gate/up fused."""
    return second_half(x, y, (o_weight, o_scales_and_zeros), norm_weight, [(gate_up_weight, gate_up_scales_and_zeros)],
                       (down_weight, down_scales_and_zeros), eps=eps)  # fmt: skip


# The two halves compiled as single graphs: inductor must store each product's input row once (the norms'
# and SwiGLU's outputs, read by 1-3 products) rather than inline its pointwise tail into every weight row's
# loop, which it does by default for a buffer read this few times and which made such a graph ~2x slower
# than the separate kernels. Float products (matvec.row_sums' runs) need only that; int8 products (one run
# per row) were faster with every intermediate stored, and 2x slower with only that (docs/performance.md).
# Either way the products are the same loops as the separate kernels', and bits equal theirs
# (tests/test_decode_layouts.py).
STORE_PRODUCT_INPUTS = {"realize_reads_threshold": 0}
STORE_EVERY_BUFFER = {"realize_reads_threshold": 0, "realize_opcount_threshold": 0,
                      "realize_cpu_opcount_threshold": 0, "realize_cpu_acc_reads_threshold": 0}  # fmt: skip
attention_inputs.inductor_config = attention_output_and_mlp.inductor_config = STORE_PRODUCT_INPUTS
attention_inputs_int8.inductor_config = attention_output_and_mlp_int8.inductor_config = STORE_EVERY_BUFFER
# int8's words loop (AVX2), two slices a product: with every buffer stored, its slices ran 30.3 -> 38.2 ms a step's
# 28 layers (four slices); with the product inputs alone stored, 25.2 -> 23.0 (two; Zen 3, docs/performance.md)
attention_inputs_int8_words.inductor_config = attention_output_and_mlp_int8_words.inductor_config = STORE_PRODUCT_INPUTS
# int4's words loop reads its row one number at a time (a broadcast per column): the row stored once, as for
# the float halves (with int8's STORE_EVERY_BUFFER inductor stored every unpacked nibble: 125 ms a step), and
# nothing else stored that the loop's own kernel keeps in registers (int4.NEVER_STORE's other thresholds: with
# inductor's defaults each product stored its per-group sums and widened scales and applied them in a second
# loop: the 28 layers' halves took 28.5 ms a step on an AMD EPYC Zen 3, now 19.9, with the same bits); the
# multiply-adds fused, as in the loop's own kernels (int4.FUSED_MULTIPLY_ADD)
attention_inputs_int4_words.inductor_config = attention_output_and_mlp_int4_words.inductor_config = {
    **NEVER_STORE, **STORE_PRODUCT_INPUTS, **FUSED_MULTIPLY_ADD}
# The pairs' loop stores its own input (each row rounded to int8 codes, int4_pairs.rounded) and nothing else: with
# the words' setting inductor stored more of it, and the 28 layers' halves took 39 ms against the words' 27 (Zen 3)
attention_inputs_int4_pairs.inductor_config = attention_output_and_mlp_int4_pairs.inductor_config = {
    **NEVER_STORE, **FUSED_MULTIPLY_ADD}
# int4's products are torch's own kernel, called from inside the graph: their inputs are stored whatever the
# config (an extern call reads a buffer), so the defaults; its halves buy the calls between the products
# (4 kernels, ~20 ops a layer), ~65 us a layer on the AMD EPYC (docs/performance.md)
HALVES = {"float": (attention_inputs, attention_output_and_mlp),
          "int8": (attention_inputs_int8, attention_output_and_mlp_int8),
          "int8-words": (attention_inputs_int8_words, attention_output_and_mlp_int8_words),
          "int4": (attention_inputs_int4, attention_output_and_mlp_int4),
          "int4-words": (attention_inputs_int4_words, attention_output_and_mlp_int4_words),
          "int4-pairs": (attention_inputs_int4_pairs, attention_output_and_mlp_int4_pairs)}  # fmt: skip


SHORT_CONTEXT = 256  # attended slots up to which half-precision attention runs in fp32 (0: never)


def attend_in_fp32(attn, q, k, v, mask, cache, cache_slots):
    """Attention.attend for one token of one row, in fp32 over keys and values widened for this step:
    q (1, H, 1, D), k, v (1, K, 1, D) -> (1, 1, H*D) in q's dtype. The cache stays in its own dtype.

    In fp32, SDPA's CPU kernel (one call for the layer's heads) is faster than one_query_attention's two
    batched products and softmax: on the AMD EPYC, one layer at 32 / 80 / 160 / 256 slots, 50 / 87 / 146 /
    215 us against 75 / 140 / 187 / 268, and a 0.6B decode 21.06 -> 22.03 tok/s in bf16, 29.6 -> 30.8 with
    int4 weights (medians of 5, alternating in one process; docs/performance.md). (In half precision the
    same kernel is the slow one there: see attend_flash.)"""
    keys, values = cache.update(attn.layer_index, k, v, cache_slots)  # (1, K, max_len, D)
    S = mask.shape[-1]  # the slots attended: as Attention.attend
    y = F.scaled_dot_product_attention(q.float(), keys[:, :, :S].float(), values[:, :, :S].float(), attn_mask=mask,
                                       enable_gqa=True)  # (1, H, 1, D)  # fmt: skip
    return y.to(q.dtype).view(1, 1, attn.n_heads * attn.head_dim)  # one query row: (1, H, 1, D) is (1, 1, H*D)


def has_amx() -> bool:
    """True on a CPU with AMX's bf16 tiles (Intel Sapphire Rapids and later), where SDPA's flash kernel is fast."""
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " amx_bf16" in line for line in f)
    except OSError:
        return False


FLASH_ATTENTION = has_amx()  # half-precision decode attends with SDPA's flash kernel (see attend_flash)


def attend_flash(attn, q, k, v, mask, cache, cache_slots):
    """Attention.attend for one token of one row by SDPA's CPU flash kernel, in the cache's own dtype:
    q (1, H, 1, D), k, v (1, K, 1, D) -> (1, 1, H*D). One call for the layer's heads instead of a widening
    copy of the cache and two small oneDNN products: on an Intel Xeon with AMX (1 thread) 24 us a layer
    at 64 slots and 61 at 256, against 202 and 259 for attend_in_fp32 and 266 and 768 for the eager bf16
    products (docs/performance.md, "CPU decode step on the Intel Xeon"). Its sums and softmax are fp32, as
    attend_in_fp32's; the probabilities meet the values in bf16, so it is held to the same bf16 bounds.
    Not used without AMX: on the AMD EPYC (Zen 4) the same kernel read a bf16 cache slowly."""
    keys, values = cache.update(attn.layer_index, k, v, cache_slots)  # (1, K, max_len, D)
    S = mask.shape[-1]  # the slots attended: as Attention.attend
    y = F.scaled_dot_product_attention(q, keys[:, :, :S], values[:, :, :S], attn_mask=mask, enable_gqa=True)
    return y.reshape(1, 1, attn.n_heads * attn.head_dim)  # one query row: (1, H, 1, D) is (1, 1, H*D)


ONE_ROW_KERNEL = True  # decode attends by one_row_attention's stored kernel where stored kernels are on


def pick_attention(attn, q, mask):
    """The decode step's attention: in half precision SDPA's flash kernel where AMX runs it; else, with stored
    kernels on, one_row_attention's kernel (one call over the cache in place: 2-4x faster than the routes below);
    else, in half precision, fp32 while the context is short; else the model's own."""
    if mask is None:
        return type(attn).attend
    half = q.dtype != torch.float32
    if half and FLASH_ATTENTION:
        return attend_flash
    if ONE_ROW_KERNEL and one_row_attention.available(attn, q):
        return one_row_attention.attend
    return attend_in_fp32 if half and mask.shape[-1] <= SHORT_CONTEXT else type(attn).attend


def swiglu(gate, up, *, wide: bool):
    return widen(F.silu(gate) * up, wide)  # (1, 1, F)


class CPUDecoderLayer(DecoderLayer):
    """DecoderLayer with a fast path for one token of one row on a CPU (the class swapped in at load)."""

    def forward(self, x, cos, sin, mask=None, cache=None, cache_slots=None):
        if x.shape[:2] != (1, 1) or cache is None or not x.is_cpu or torch.compiler.is_compiling():
            return super().forward(x, cos, sin, mask, cache, cache_slots)  # torch.compile traces the plain maths
        step = self.__dict__.get("_step")
        if step is not None:  # every step after the layer's first
            return step(x, cos, sin, mask, cache, cache_slots)
        attn = self.self_attn
        halves = self.halves()
        if halves is not None:  # two kernels a layer around its attention
            first, first_weights, second, second_weights, shape = halves
            q, k, v = self.kernel(first, x, *first_weights, cos, sin, **shape)
            y = pick_attention(attn, q, mask)(attn, q, k, v, mask, cache, cache_slots)  # (1, 1, H*D)
            x = self.kernel(second, x, y, *second_weights, eps=shape["eps"])
            kernels = self.__dict__["_kernels"]
            self.__dict__["_step"] = HalvesStep(attn, kernels[first], first_weights, kernels[second], second_weights)
            return x
        # any other layer: its products as they are (tensor-parallel, a mixture of experts), the ops between them
        # as four kernels taking and giving rows in the activations' dtype
        mlp, eps = self.mlp, self.input_layernorm.eps
        shape = dict(n_heads=attn.n_heads, n_kv_heads=attn.n_kv_heads, head_dim=attn.head_dim, eps=eps)
        h = self.kernel(norm, x, self.input_layernorm.weight, eps=eps, wide=False)
        q, k, v = attn.project_qkv(h)  # (1, 1, H*D), (1, 1, K*D), (1, 1, K*D)
        q, k, v = self.kernel(heads, q, k, v, attn.q_norm.weight, attn.k_norm.weight, cos, sin, **shape)
        attend = pick_attention(attn, q, mask)
        y = attn.o_proj(attend(attn, q, k, v, mask, cache, cache_slots))  # (1, 1, C)
        x, h = self.kernel(residual_norm, x, y, self.post_attention_layernorm.weight, eps=eps, wide=False)
        if not isinstance(mlp, MLP):  # a mixture of experts keeps its own forward (model/moe.py)
            return x + mlp(h)
        if hasattr(mlp, "gate_up_proj"):
            gate, up = mlp.gate_up_proj(h).split(mlp.gate_up_proj.split_sizes, dim=-1)
        else:
            gate, up = mlp.gate_proj(h), mlp.up_proj(h)
        h = self.kernel(swiglu, gate.contiguous(), up.contiguous(), wide=False)
        return x + mlp.down_proj(h)

    def halves(self) -> tuple | None:
        """(first kernel's function, the tensors it reads besides the step's x, cos and sin, second kernel's
        function, the tensors it reads besides x and y, the shape constants), or None where the layer does not
        run as two kernels (whole_halves). Gathered once per layer: otherwise ~28 us of lists and attribute
        lookups a layer and step (docs/performance.md)."""
        if "_halves" not in self.__dict__:
            scheme, halves = self.whole_halves(), None
            if scheme is not None:
                attn = self.self_attn
                first, second = HALVES[scheme]
                qkv, o, gate_up, down = self.products()
                first_weights = (self.input_layernorm.weight, *self.weights(*qkv), attn.q_norm.weight, attn.k_norm.weight)
                second_weights = (*self.weights(o), self.post_attention_layernorm.weight, *self.weights(*gate_up, down))
                shape = dict(n_heads=attn.n_heads, n_kv_heads=attn.n_kv_heads, head_dim=attn.head_dim,
                             eps=self.input_layernorm.eps)  # fmt: skip
                halves = (first, first_weights, second, second_weights, shape)
            self.__dict__["_halves"] = halves
        return self.__dict__["_halves"]

    def whole_halves(self) -> str | None:
        """"float", "int8", "int8-words", "int4", "int4-words" or "int4-pairs" when the layer runs as two whole-half
        kernels, else None: a dense layer whose products are its own (not through a tensor-parallel wrapper), without
        bias, either the "decode" layout's MatvecLinears over the checkpoint's own matrices, or int8 ones on their
        compiled CPU loop (in one layout: codes, or words), or int4 ones in one layout (q/k/v and gate/up fused, as
        quantize_model lays them out). Looked up once per layer."""
        if "_whole_halves" not in self.__dict__:
            attn, mlp, scheme = self.self_attn, self.mlp, None
            if isinstance(mlp, MLP):
                fused = (hasattr(attn, "qkv_proj"), hasattr(mlp, "gate_up_proj"))
                qkv, o, gate_up, down = self.products()
                products = [*qkv, o, *gate_up, down]
                if fused == (False, False) and all(isinstance(m, MatvecLinear) and m.bias is None for m in products):
                    scheme = "float"
                int8 = [isinstance(m, Int8Linear) and m.route == "cpu" and m.kernel is not None for m in products]
                if fused == (True, True) and all(int8) and all(m.bias is None for m in products):
                    words = {m.words for m in products}
                    scheme = ("int8-words" if words.pop() else "int8") if len(words) == 1 else None
                if fused == (True, True) and all(isinstance(m, Int4Linear) and m.bias is None for m in products):
                    layouts = {"-pairs" if isinstance(m, Int4PairsLinear) else "-words" if m.words else ""
                               for m in products}  # fmt: skip
                    scheme = f"int4{layouts.pop()}" if len(layouts) == 1 else None
            self.__dict__["_whole_halves"] = scheme
        return self.__dict__["_whole_halves"]

    def products(self) -> tuple[list, nn.Module, list, nn.Module]:
        """The layer's products: q/k/v (fused or three), o, gate/up (fused or two), down."""
        attn, mlp = self.self_attn, self.mlp
        qkv = [attn.qkv_proj] if hasattr(attn, "qkv_proj") else [attn.q_proj, attn.k_proj, attn.v_proj]
        gate_up = [mlp.gate_up_proj] if hasattr(mlp, "gate_up_proj") else [mlp.gate_proj, mlp.up_proj]
        return qkv, attn.o_proj, gate_up, mlp.down_proj

    @staticmethod
    def weights(*products) -> list[torch.Tensor]:
        """The tensors a whole-half kernel reads for these products: each one's weight, and its scales if int8,
        its scales and zeros if int4 (an int8 product's codes, and int4's words and their scales, as the one-row
        loops read them: Int8Linear.codes, Int4Linear.codes and .scale_words)."""
        tensors = []
        for m in products:
            if isinstance(m, Int4Linear) and m.words:
                tensors += [m.codes, m.scale_words]
            else:
                tensors += [m.codes if isinstance(m, Int8Linear) else m.weight,
                            *(getattr(m, name) for name in SCALES if hasattr(m, name))]  # fmt: skip
        return tensors

    def kernel(self, fn, *args, **constants):
        """fn's compiled kernel, looked up once per layer and function (every decode step has the same
        shapes), called on contiguous arguments as compiled."""
        kernels = self.__dict__.setdefault("_kernels", {})
        compiled = kernels.get(fn)
        if compiled is None:
            compiled = kernels[fn] = kernel(fn, *args, **constants)
        return compiled(*[a.contiguous() for a in args])


class HalvesStep:
    """A layer's decode step as its two kernels around its attention, once the layer's first step has found them:
    the kernels and the tensors they read in hand, so that a step calls them without the lookups of the first
    (the kernels' dictionary, their argument lists, the shape constants: ~15 us a layer and step, 0.4 ms of an int4
    step's Python; docs/performance.md). The attention is picked at every step, as pick_attention says."""

    def __init__(self, attn, first, first_weights: tuple, second, second_weights: tuple):
        self.attn, self.first, self.first_weights, self.second, self.second_weights = (
            attn, first, first_weights, second, second_weights)  # fmt: skip

    def __call__(self, x, cos, sin, mask, cache, cache_slots):
        attn = self.attn
        q, k, v = self.first(x.contiguous(), *self.first_weights, cos.contiguous(), sin.contiguous())
        y = pick_attention(attn, q, mask)(attn, q, k, v, mask, cache, cache_slots)  # (1, 1, H*D)
        return self.second(x.contiguous(), y.contiguous(), *self.second_weights)


@torch.no_grad()
def use_cpu_decoder_layers(model: Qwen3) -> Qwen3:
    """Give every layer the fast decode path (the modules and their weights stay as they are), and
    build its kernels now, by running one layer on one token: at load, not as a ~1 s stall after the
    first generated token. The other layers find them built (matvec.kernel keeps them)."""
    for layer in model.model.layers:
        layer.__class__ = CPUDecoderLayer
    C, dtype = model.config.hidden_size, model.activation_dtype
    cache = KVCache(model.config, 1, 1, model.device, dtype)  # one slot, thrown away
    slot = torch.zeros(1, dtype=torch.long)
    cos, sin = model.rope_cos[slot][None], model.rope_sin[slot][None]  # (1, 1, D): position 0
    model.model.layers[0](torch.zeros(1, 1, C, dtype=dtype), cos, sin, attention_mask(slot, cache.key_valid), cache, slot)
    if isinstance(model.lm_head, MatvecLinear):
        model.lm_head.kernel  # noqa: B018 (built now, as the layers' kernels)
    return model
