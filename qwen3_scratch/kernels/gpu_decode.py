"""A decoder layer's decode step on a GPU: the ops between the products as four kernels, not ~50.

Replayed from a CUDA graph, a decode step costs what its kernels cost, and at the 0.6B shapes there were 1,636
of them, ~2 us each (an H200's profile, docs/performance.md): 58 a layer, of which the products are four. The
rest is glue on a few thousand numbers: each RMSNorm is 8 eager kernels (cast, square, mean, add, rsqrt,
multiply, cast back, weight), RoPE 5 for q and 5 for k, SwiGLU 2, the residual adds 2. Here inductor
compiles that glue into four kernels a layer around the products, which stay cuBLAS's (or the int8/int4
modules'), and the attention, which stays the model's own:

    norm -> [q/k/v product] -> q/k norm + RoPE -> attention -> [o product] -> residual + norm
    -> [gate/up product] -> SwiGLU -> [down product] -> + residual

On an H100 (docs/performance.md, "Four kernels a layer"): the 0.6B shapes' graphed step went from 1,636 kernels
to 516, and decode from 265 to 569 tok/s (above `--compile`'s ~550); 8B from 102 to 141 tok/s (57% -> 79% of
the bandwidth limit); 8B int4 from 147 to 240. The build costs ~12 s at the first start (inductor's cache on
disk spares most of it later).

Each kernel is built once per shape at its first use (matvec.kernel: make_fx on fake tensors, then inductor:
Triton on a GPU, C++ on a CPU), with no guards: a graph replays it anyway. A layout step (kernels/layout.py, "decode" on a
GPU) swaps each plain DecoderLayer's class for GPUDecoderLayer and builds the batch-1 kernels at load, on
one layer; every layer then shares them, as their shapes are the same.

The maths is the model's, in its order and with eager's roundings to bf16 (emulate_precision_casts): the
q/k norm + RoPE kernel, SwiGLU and the adds are bit for bit the eager ops; a norm's sum of squares is
inductor's own order, so its fp32 result may differ in the last bit, and a bf16 element then rounds the
other way rarely (an H100 found no such element in 4,096 random rows of 128, 1,024 or 4,096 values;
gpu_check's "norm mismatch"). Greedy tokens equal the plain layers' (tests/test_gpu_decode.py, on a CPU, where the same
kernels compile to C++).

In the simple loops only one token a row (T == 1, any batch) runs this way: a prefill is one forward whose
launches do not matter, and each new shape would be one more kernel to build. The engine's steps pack prompt
chunks and decode rows of any count into one sequence, so its layers ("batch" layout, `any_length`) run every
step this way, by kernels torch.compile builds once for any token count: nano-vLLM's workload went from 1,604 to
2,375 output tok/s on the H100. torch.compile of the whole step (`--compile`) traces the plain layer, as does
anything off the device the layers were set up for.

A CPU engine's layers ("batch" layout) run the same four kernels, stored as AOTInductor packages (kernels/aot.py),
one per kernel for any rows and tokens: there they save the ~20 eager ops of a layer's glue (a decode step of the
0.6B shapes at 4-32 rows, bf16, AMD EPYC: 8-18% shorter; scripts/bench/engine_glue.py), where torch.compile's
kernels lose part of that to dynamo's guards, four calls a layer. A process that finds no package compiles them at
load, one kernel for every token count, one token included (any_size_kernel; 10-35 s alone, once per machine,
shapes and torch; a first `qwen3-serve` start measured no slower, as it compiles other kernels too), and hands
them to the background builder, which keeps a package only if it equals the compiled kernel bit for bit: the
tokens do not depend on whether the packages were built yet. (Not eager meanwhile: a norm's sum of squares in
inductor's order differs in the last bit, and one bf16 element in ~400,000 then rounds the other way.) With
stored kernels turned off (QWEN3_SCRATCH_AOT=0, the test suite) a CPU engine runs the eager glue.
"""

import functools
import logging

import torch
import torch.nn.functional as F

from qwen3_scratch.model.kv_cache import KVCache, attention_mask
from qwen3_scratch.model.qwen3 import MLP, Attention, DecoderLayer, Qwen3, rms_norm
from qwen3_scratch.model.rope import apply_rope

from . import aot
from .matvec import kernel

log = logging.getLogger("qwen3_scratch.kernels")

_DYNAMIC: dict = {}  # function -> fn compiled once for any number of tokens
_ANY_SIZE: dict = {}  # the same on a CPU, 1 included: the kernel a stored package must equal (any_size_kernel)


def any_length_kernel(fn):
    """fn compiled by torch.compile with dynamic shapes: one kernel for every token count (after the one for a
    single token, which dynamo specialises), guarded, rounding as eager. For the engine, whose steps pack any
    number of tokens (buckets of decode rows, prompt chunks): one static kernel per count would be dozens to build."""
    compiled = _DYNAMIC.get(fn)
    if compiled is None:
        compiled = _DYNAMIC[fn] = torch.compile(fn, dynamic=True, fullgraph=True, options=dict(aot.INDUCTOR_OPTIONS))
    return compiled


def any_size_kernel(fn):
    """any_length_kernel on a CPU: one kernel for every token count, one token included
    (aot.compile_for_any_size), so that it is the kernel a stored package runs, bit for bit."""
    compiled = _ANY_SIZE.get(fn)
    if compiled is None:
        compiled = _ANY_SIZE[fn] = aot.compile_for_any_size(fn, aot.INDUCTOR_OPTIONS)
    return compiled


# Sizes a stored any-length kernel is exported at (the first) and checked at against the compiled kernel (all):
# rows B and tokens T. The first avoids 1s, which torch.export would take for constants.
PACKAGE_SIZES = [dict(B=2, T=3), dict(B=1, T=1), dict(B=1, T=37), dict(B=3, T=130)]


def stored_any_length_kernel(fn, args: list[torch.Tensor], constants: dict):
    """fn's stored package for any rows and tokens (dimensions 0 and 1 of each argument that has them; the
    others as these arguments have them), loaded without the compiler, or None: none stored yet, and the
    kernel is handed to the background builder. One lookup per function, dtypes, fixed sizes and constants."""
    shapes = tuple((a.dtype, tuple(["B", "T", *a.shape[2:]] if a.dim() >= 3 else a.shape)) for a in args)
    return _stored(fn, shapes, tuple(sorted(constants.items())))


@functools.cache
def _stored(fn, shapes: tuple, constants: tuple):
    shapes_only = [list(shape) for _, shape in shapes]
    args = [torch.empty(0, dtype=dtype) for dtype, _ in shapes]  # the key reads their dtypes; the sizes are named
    dynamic = {"shapes": shapes_only, "examples": "qwen3_scratch.kernels.aot_build:examples",
               "reference": aot.ANY_SIZE, "sizes": PACKAGE_SIZES, "inductor": dict(aot.INDUCTOR_OPTIONS)}  # fmt: skip
    return aot.load_or_remember(fn, args, dict(constants), dynamic)


# ---- the four kernels (x, y: (B, T, C) rows; the products' outputs as they come) ---------------------------


def norm(x, weight, *, eps: float):
    return rms_norm(x, weight, eps)


def heads(qkv, q_weight, k_weight, cos, sin, *, n_heads: int, n_kv_heads: int, head_dim: int, eps: float):
    """Attention.forward between its projections and its attention: qkv (B, T, (H + 2K) * D), the q, k and v
    products side by side (one fused product, or the three concatenated) -> q (B, H, T, D), k, v (B, K, T, D)."""
    B, T, _ = qkv.shape
    q, k, v = qkv.split([n_heads * head_dim, n_kv_heads * head_dim, n_kv_heads * head_dim], dim=-1)
    q = rms_norm(q.reshape(B, T, n_heads, head_dim), q_weight, eps).transpose(1, 2)
    k = rms_norm(k.reshape(B, T, n_kv_heads, head_dim), k_weight, eps).transpose(1, 2)
    v = v.reshape(B, T, n_kv_heads, head_dim).transpose(1, 2)
    return apply_rope(q, cos, sin).contiguous(), apply_rope(k, cos, sin).contiguous(), v.contiguous()


def residual_norm(x, y, weight, *, eps: float):
    """The residual add and the next norm: x + y, and rms_norm(x + y)."""
    x = x + y
    return x, rms_norm(x, weight, eps)


def swiglu(gate_up):
    """gate_up (B, T, 2F): the gate and up products side by side -> silu(gate) * up (B, T, F)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class GPUDecoderLayer(DecoderLayer):
    """DecoderLayer whose one-token steps (any step, with any_length) run the glue as four compiled kernels
    around its products and attention (the class swapped in at load; its modules and weights stay as they are)."""

    any_length = False  # True (the engine's layers): every step runs the glue, for any token count

    def forward(self, x, cos, sin, mask=None, cache=None, cache_slots=None):
        plain = x.shape[1] != 1 and not self.any_length
        if plain or x.device != self.glue_device or torch.compiler.is_compiling():
            return super().forward(x, cos, sin, mask, cache, cache_slots)
        attn, mlp, eps = self.self_attn, self.mlp, self.input_layernorm.eps
        h = self.run(norm, x, self.input_layernorm.weight, eps=eps)
        qkv = attn.qkv_proj(h) if hasattr(attn, "qkv_proj") else torch.cat(attn.project_qkv(h), dim=-1)
        shape = {"n_heads": attn.n_heads, "n_kv_heads": attn.n_kv_heads, "head_dim": attn.head_dim, "eps": eps}
        q, k, v = self.run(heads, qkv, attn.q_norm.weight, attn.k_norm.weight, cos, sin, **shape)
        y = attn.o_proj(attn.attend(q, k, v, mask, cache, cache_slots))  # (B, T, C)
        x, h = self.run(residual_norm, x, y, self.post_attention_layernorm.weight, eps=eps)
        if not isinstance(mlp, MLP):  # a mixture of experts keeps its own forward (model/moe.py)
            return x + mlp(h)
        if hasattr(mlp, "gate_up_proj"):
            gate_up = mlp.gate_up_proj(h)
        else:
            gate_up = torch.cat([mlp.gate_proj(h), mlp.up_proj(h)], dim=-1)
        return x + mlp.down_proj(self.run(swiglu, gate_up))

    def run(self, fn, *args, **constants):
        """fn's kernel for these arguments: one built for their exact shapes, or (any_length) for any count; on a
        CPU, for any count, the stored package, else the compiled kernel (or the eager ops: stored kernels off)."""
        if self.any_length and self.glue_device.type == "cpu":
            glue = self.__dict__.setdefault("_glue", {})
            if fn not in glue:  # looked up once per layer and function: every later step has the same dtypes
                glue[fn] = self.cpu_glue(fn, args, constants)
            return glue[fn](*args)
        if self.any_length:
            return any_length_kernel(fn)(*args, **constants)
        args = [a.contiguous() for a in args]
        return kernel(fn, *args, **constants)(*args)

    @staticmethod
    def cpu_glue(fn, args, constants: dict):
        """What runs fn on a CPU engine's steps: its stored package, else (stored kernels on) the compiled kernel
        the builder will package (any_size_kernel), else the eager ops."""
        stored = stored_any_length_kernel(fn, args, constants)
        if stored is not None:
            return lambda *args: stored(*[a.contiguous() for a in args])
        compiled = any_size_kernel(fn) if aot.enabled() else fn
        return lambda *args: compiled(*args, **constants)


@torch.no_grad()
def use_gpu_decoder_layers(model: Qwen3, any_length: bool = False) -> bool:
    """Give every plain dense or MoE layer the compiled-glue decode step on the model's device, and build its
    batch-1 kernels now, on one layer and one token. False (the layers left plain, a warning logged) if
    inductor cannot build them here (no Triton, no compiler): the model then runs as it was.

    any_length: every forward runs the glue, whatever its token count (the engine's "batch" layout: its steps
    are many rows packed as one sequence), by kernels compiled for any count; built now for one token and for
    several; on a CPU loaded, or built where none is stored (see the module's docstring)."""
    layers = [layer for layer in model.model.layers if type(layer) is DecoderLayer and type(layer.self_attn) is Attention]
    if not layers:
        return False
    for layer in layers:
        layer.__class__ = GPUDecoderLayer
        layer.glue_device, layer.any_length = model.device, any_length
    try:
        C, dtype, device = model.config.hidden_size, model.activation_dtype, model.device
        if model.rope_cos.numel() == 0:
            model.build_rope_tables(device, dtype)
        for n in (1, 2) if any_length else (1,):  # one token; and several, for kernels of any count
            cache, slots = KVCache(model.config, 1, n, device, dtype), torch.arange(n, device=device)  # thrown away
            # (1, n, D): positions 0..n-1, indexed as Qwen3.forward does (a fresh tensor, not a view: a view's
            # base would be guarded on, and the engine's first prompt step would compile `heads` again)
            cos, sin = model.rope_cos[slots[None]], model.rope_sin[slots[None]]
            layers[0](torch.zeros(1, n, C, dtype=dtype, device=device), cos, sin,
                      attention_mask(slots, cache.key_valid), cache, slots)  # fmt: skip
    except Exception as e:  # noqa: BLE001 - any compiler failure: the plain layers still run
        for layer in layers:
            layer.__class__ = DecoderLayer
            del layer.glue_device, layer.any_length
        log.warning("decode runs without compiled glue kernels (%s: %s)", type(e).__name__, str(e)[:200])
        return False
    return True
