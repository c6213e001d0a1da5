"""Products of a few activation rows (2 to 16) with a bf16 matrix on a CPU, the rows sharing one read of it.

Speculative decoding (generation/speculative.py) checks k proposed tokens in one forward over k+1
positions. That only pays if k+1 rows cost about what one row costs: decode is bound by reading the
weights, and k+1 rows still read each weight once, if the kernel lets them. torch's F.linear (oneDNN)
does not, for bf16 at these sizes: at every call it first reorders the whole matrix into its blocked
layout, so 2 to 8 rows of Qwen3-0.6B's matrices take about twice the time of the compiled one-row loop
(matvec.py), and a verification forward costs about two decode steps.

Reordered once instead, here, oneDNN's kernel reads each weight once for all the rows:

    packed = torch.ops.mkldnn._reorder_linear_weight(W, hint)      # once, when speculation starts
    y = torch.ops.mkldnn._linear_pointwise(x, packed, ...)         # (R, N), every verification

the same pair fuse.py's PackedLinear uses for the engine's steps. Measured at the 0.6B shapes on a 2-core
Zen 4, one layer's 7 products with 28 layers' matrices cycling (so not from the cache), ms, two passes
(docs/performance.md, "The few-row products in pure PyTorch"):

    rows                      1           2           3           5           8           16
    one-row loop (matvec)     0.92-1.12
    F.linear                              1.78-2.26   1.88-2.34   2.18-2.52   2.23-2.86   3.34-3.37
    prepacked (this file)                 1.20-1.41*  1.22-1.37   1.13-1.21   1.43-1.49   1.84-1.89
    C++ it replaced (AVX512-BF16 intrinsics, not pure PyTorch)
                                          1.07-1.25   1.35-1.37   1.60-1.63   2.47-2.54   4.32-4.38

* oneDNN's own kernel for 2 rows is slower than its 3-row one (1.45-1.59 ms measured apart), so 2 rows
  run as 3, the third zeros. Rows do not mix in a product, so this changes no bit of the first two.

A verification's layer (FewRowDecoderLayer) runs four such products, not seven: q/k/v packed as one matrix and
gate/up as one, with the ops between them called directly (a 2-6 row verification of the 0.6B shapes: 1.28-1.45
one-row steps, from 1.37-1.52 over seven products and the modules' forwards).

The cost is memory: the packed copy sits beside the checkpoint's matrix, which the one-row loop keeps
reading (it is faster there than oneDNN's single-row kernel, 0.93 against 1.18 ms). So the copy is made
only for a model that speculates (`use_fewrow`, called by generation/speculative.make_speculator), not
at load: for Qwen3-0.6B it is 1.2 GB more, and 1.5 s to make right after a load (the packing is the
first to read the mapped checkpoint). Where the copies would not fit beside the matrices in the memory available
(`too_big_reason`), none is made.

Exactness: each output is oneDNN's fp32 sum of exact bf16 products, rounded once to bf16, which is what
F.linear computes (tests/test_fewrow.py: within bf16 rounding of the exact product).
Where oneDNN has no bf16 kernel for this CPU, or for other dtypes, F.linear runs, as before.

Shapes: R activation rows, N out_features, K in_features.
"""

import functools
import warnings

import torch
import torch.nn.functional as F

from qwen3_scratch.model.qwen3 import rms_norm
from qwen3_scratch.model.rope import apply_rope

from .cpu_decode import CPUDecoderLayer
from .matvec import MatvecLinear

MAX_ROWS = 16  # a verification of up to 15 proposed tokens; more rows than this go to F.linear
PACKING_HINT = 4  # the batch size oneDNN picks its layout for; 1, 2, 4 and 16 measured level at 2-12 rows
SLOW_ROWS = {2: 3}  # row counts oneDNN runs faster padded with zero rows (above)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """A copy of weight (N, K) in oneDNN's blocked layout (an opaque tensor, used only by `fewrow`)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACKING_HINT)


def fewrow(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (R, K) bf16 times the packed (N, K) bf16 matrix transposed -> (R, N) bf16, 1 <= R <= MAX_ROWS."""
    rows = x.shape[0]
    if rows in SLOW_ROWS:
        x = torch.cat([x, x.new_zeros(SLOW_ROWS[rows] - rows, x.shape[1])])
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")[:rows]


@functools.cache
def unavailable_reason() -> str | None:
    """None if oneDNN multiplies bf16 on this CPU; otherwise why not."""
    if not torch.backends.mkldnn.is_available():
        return "this torch has no oneDNN"
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "oneDNN has no bf16 kernel for this CPU"
    return None


def too_big_reason(copies: int) -> str | None:
    """None if `copies` bytes of packed matrices fit beside the matrices themselves in the memory this machine has
    available; otherwise why not. The one-row steps keep reading the checkpoint's matrices (memory-mapped), so both
    must stay resident: Qwen3-8B's 16 GB of copies on a 24 GB machine would push its weights out of memory and
    make every step read them from disk again."""
    available = available_memory()
    if available is None or 2 * copies <= available:
        return None
    return (f"their packed copies need {copies / 2**30:.1f} GiB, and the model's matrices as much again; "
            f"{available / 2**30:.1f} GiB of memory is available")


def available_memory() -> int | None:
    """MemAvailable from /proc/meminfo, in bytes (what can be allocated without swapping; it counts the page cache,
    the mapped checkpoint's pages included, as free), or None where there is no such file."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


class FewRowLinear(MatvecLinear):
    """MatvecLinear that also keeps its matrix packed for oneDNN (`packed`), for products of 2..MAX_ROWS rows."""

    packed: torch.Tensor  # set by use_fewrow; a plain attribute, so the state dict is the checkpoint's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if not 1 < rows <= MAX_ROWS or x.dtype != torch.bfloat16 or torch.compiler.is_compiling():
            return super().forward(x)
        y = fewrow(x.reshape(rows, self.in_features), self.packed, self.bias)  # (R, N)
        return y.view(*x.shape[:-1], self.out_features)


class FewRowDecoderLayer(CPUDecoderLayer):
    """CPUDecoderLayer whose forwards over 2..MAX_ROWS tokens of one sequence (a verification) read packed copies,
    q/k/v as one product and gate/up as one (use_fewrow packs them side by side), with the ops between the products
    called directly rather than through each module's forward: the model's maths in its order, so the same bits as
    the layer's own forward over the same products. Against that forward over FewRowLinears (7 products a layer,
    13 module calls), a 2-6 row verification of the 0.6B shapes went from 1.37-1.52 to 1.28-1.45 one-row steps
    on a noisy host (docs/performance.md, "A verification as four products a layer")."""

    qkv_packed: torch.Tensor  # q's, k's and v's matrices stacked, packed: (H*D + 2*K*D, C)
    gate_up_packed: torch.Tensor  # gate's and up's stacked, packed: (2F, C)
    qk_norm_weight: torch.Tensor  # q_norm's weight for each query head, then k_norm's for each kv head: (H+K, D)

    def forward(self, x, cos, sin, mask=None, cache=None, cache_slots=None):
        B, T, C = x.shape
        if B != 1 or not 1 < T <= MAX_ROWS or x.dtype != torch.bfloat16 or torch.compiler.is_compiling():
            return super().forward(x, cos, sin, mask, cache, cache_slots)
        attn, mlp, eps = self.self_attn, self.mlp, self.input_layernorm.eps
        H, K, D = attn.n_heads, attn.n_kv_heads, attn.head_dim
        h = rms_norm(x, self.input_layernorm.weight, eps).view(T, C)
        qk, v = fewrow(h, self.qkv_packed).split([(H + K) * D, K * D], dim=-1)  # (T, (H+K)*D), (T, K*D)
        # q's and k's heads normed and rotated together: each head's norm is its own row, so this is the
        # model's per-head maths, with half the calls
        qk = rms_norm(qk.view(1, T, H + K, D), self.qk_norm_weight, attn.q_norm.eps).transpose(1, 2)  # (1, H+K, T, D)
        q, k = apply_rope(qk, cos, sin).split([H, K], dim=1)  # (1, H, T, D), (1, K, T, D)
        v = v.view(1, T, K, D).transpose(1, 2)  # (1, K, T, D)
        y = attn.attend(q, k, v, mask, cache, cache_slots)  # (1, T, H*D)
        x = x + fewrow(y.view(T, H * D), attn.o_proj.packed).view(1, T, C)
        h = rms_norm(x, self.post_attention_layernorm.weight, eps).view(T, C)
        gate, up = fewrow(h, self.gate_up_packed).chunk(2, dim=-1)  # (T, F) each
        return x + fewrow(F.silu(gate) * up, mlp.down_proj.packed).view(1, T, C)


@torch.no_grad()
def use_fewrow(model) -> bool:
    """Give every bf16 MatvecLinear of a CPU model (the "decode" layout) a packed copy for few-row products, and
    every plain layer over them (CPUDecoderLayer.whole_halves: "float") its q/k/v and gate/up packed side by side
    instead of one by one; False where there is nothing to do (another layout or dtype) or oneDNN cannot (with a
    warning)."""
    weight = model.model.embed_tokens.weight
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16:
        return False  # fp32 and fp16 keep F.linear (fp32's few-row products were not measured slow)
    if getattr(model, "fewrow", False):
        return True  # done already
    linears = [module for module in model.modules() if type(module) is MatvecLinear and module.weight.dtype == torch.bfloat16]
    if not linears:
        return False  # another layout
    reason = unavailable_reason() or too_big_reason(sum(m.weight.nbytes for m in linears))
    if reason is not None:
        warnings.warn(f"few-row bf16 products are unavailable ({reason}); using F.linear", stacklevel=2)
        return False
    stacked = set()  # the matrices a FewRowDecoderLayer reads stacked with others
    for layer in model.model.layers:
        if type(layer) is CPUDecoderLayer and layer.whole_halves() == "float":
            attn, mlp = layer.self_attn, layer.mlp
            layer.qkv_packed = pack(torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
            layer.gate_up_packed = pack(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
            layer.qk_norm_weight = torch.cat([attn.q_norm.weight.expand(attn.n_heads, -1),
                                              attn.k_norm.weight.expand(attn.n_kv_heads, -1)])  # fmt: skip
            layer.__class__ = FewRowDecoderLayer
            stacked.update((attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj))
    for module in linears:
        if module not in stacked:
            module.packed = pack(module.weight)
            module.__class__ = FewRowLinear
    model.fewrow = True  # what speculative decoding's cost model reads (generation/speculative.forward_cost)
    return True
