"""Load-time transforms for batch-1 decode speed. The checkpoint, its key names and the strict loader
are untouched: these run on the model load_model returns, one layer at a time, so there is never a
second copy of the whole model in RAM.

Batch-1 decode is a chain of matrix-vector products: every step streams every weight from memory once,
so its speed is how fast the matmul kernel reads weights. Two transforms make the kernels read faster:

  - fuse_projections: q/k/v become one (H*D + 2*K*D, C) matrix and gate/up one (2F, C) matrix, so a
    layer runs 4 products instead of 7, each a longer stream. Module names in the checkpoint stay as
    they are; the fused modules exist only in memory (`self_attn.qkv_proj`, `mlp.gate_up_proj`).
  - prepack_for_cpu: each matrix is reordered once into oneDNN's blocked layout and multiplied with
    oneDNN's own kernel, which streams weights near the memory bandwidth where the default batch-1
    path (a GEMV) does not (docs/performance.md has the per-op figures).

Exactness: a fused or prepacked product sums each output element in a different order than separate
F.linear calls, so fp32 logits differ from transformers' by float rounding (~1e-6 relative), no more.

Shapes: C hidden_size, H query heads, K kv heads, D head_dim, F intermediate_size, V vocab.
"""

import torch
from torch import nn

from qwen3_scratch.model.moe import SparseMoeBlock
from qwen3_scratch.model.qwen3 import MLP, Qwen3


def fused_linear(parts: list[nn.Linear]) -> nn.Linear:
    """One nn.Linear whose output is the parts' outputs side by side; `split_sizes` splits it back."""
    weight = torch.cat([p.weight.detach() for p in parts])  # (sum of out_features, C)
    has_bias = parts[0].bias is not None
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=has_bias, device="meta")
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if has_bias:
        fused.bias = nn.Parameter(torch.cat([p.bias.detach() for p in parts]), requires_grad=False)
    fused.split_sizes = [p.out_features for p in parts]
    return fused


@torch.no_grad()
def fuse_projections(model: Qwen3) -> Qwen3:
    """q/k/v -> self_attn.qkv_proj and gate/up -> mlp.gate_up_proj in every layer, in place."""
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj = fused_linear([attn.q_proj, attn.k_proj, attn.v_proj])  # (H*D + 2*K*D, C)
        del attn.q_proj, attn.k_proj, attn.v_proj  # the separate matrices are freed layer by layer
        if isinstance(mlp, MLP):  # a MoE layer's experts keep their own layout (model/moe.py)
            mlp.gate_up_proj = fused_linear([mlp.gate_proj, mlp.up_proj])  # (2F, C)
            del mlp.gate_proj, mlp.up_proj
    return model


def in_moe_block(model: Qwen3, name: str) -> bool:
    """True for the router and experts of a MoE layer, which these transforms leave as model/moe.py wrote them."""
    parts = name.split(".")
    return any(isinstance(model.get_submodule(".".join(parts[:i])), SparseMoeBlock) for i in range(1, len(parts)))


class PackedLinear(nn.Module):
    """x @ W.T with W kept in oneDNN's blocked layout (reordered once, here, not at every call)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.split_sizes = getattr(linear, "split_sizes", None)
        # batch-size hint 1: pick the layout for decode's single row; longer inputs (prefill) still work
        packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 1)  # (N, C), opaque layout
        self.weight = nn.Parameter(packed, requires_grad=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")  # (..., N)


def can_prepack(model: Qwen3) -> bool:
    """oneDNN packing needs a CPU tensor and oneDNN in this torch build (bf16: a CPU oneDNN supports)."""
    weight = model.model.embed_tokens.weight
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return weight.dtype == torch.float32


@torch.no_grad()
def prepack_for_cpu(model: Qwen3) -> Qwen3:
    """Replace every nn.Linear (the projections and lm_head) by a PackedLinear, in place.

    A tied lm_head gets its own packed copy; the embedding stays as loaded (a lookup reads one row).
    Quantized layers (quantize.py) are not nn.Linear and are left as they are.
    """
    if not can_prepack(model):
        return model
    return replace_linears(model, PackedLinear)


def replace_linears(model: Qwen3, build) -> Qwen3:
    """Every nn.Linear outside a MoE block (the projections and lm_head) becomes build(linear), in place."""
    # names, not modules: holding every replaced module in a list would keep all the old matrices alive
    # until the loop ends (a second copy of the model); this way each is freed as soon as it is replaced
    names = [name for name, module in model.named_modules() if type(module) is nn.Linear and not in_moe_block(model, name)]
    for name in names:
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name), attr, build(model.get_submodule(name)))
    return model
