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

The cost is memory: the packed copy sits beside the checkpoint's matrix, which the one-row loop keeps
reading (it is faster there than oneDNN's single-row kernel, 0.93 against 1.18 ms). So the copy is made
only for a model that speculates (`use_fewrow`, called by generation/speculative.make_speculator), not
at load: for Qwen3-0.6B it is 1.2 GB more, and 1.5 s to make right after a load (the packing is the
first to read the mapped checkpoint).

Exactness: each output is oneDNN's fp32 sum of exact bf16 products, rounded once to bf16, which is what
F.linear computes (tests/test_fewrow.py: within bf16 rounding of the exact product).
Where oneDNN has no bf16 kernel for this CPU, or for other dtypes, F.linear runs, as before.

Shapes: R activation rows, N out_features, K in_features.
"""

import functools
import warnings

import torch

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


class FewRowLinear(MatvecLinear):
    """MatvecLinear that also keeps its matrix packed for oneDNN (`packed`), for products of 2..MAX_ROWS rows."""

    packed: torch.Tensor  # set by use_fewrow; a plain attribute, so the state dict is the checkpoint's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if not 1 < rows <= MAX_ROWS or x.dtype != torch.bfloat16 or torch.compiler.is_compiling():
            return super().forward(x)
        y = fewrow(x.reshape(rows, self.in_features), self.packed, self.bias)  # (R, N)
        return y.view(*x.shape[:-1], self.out_features)


@torch.no_grad()
def use_fewrow(model) -> bool:
    """Give every bf16 MatvecLinear of a CPU model (the "decode" layout) a packed copy for few-row products;
    False where there is nothing to do (another layout or dtype) or oneDNN cannot (with a warning)."""
    weight = model.model.embed_tokens.weight
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16:
        return False  # fp32 and fp16 keep F.linear (fp32's few-row products were not measured slow)
    linears = [module for module in model.modules() if type(module) is MatvecLinear and module.weight.dtype == torch.bfloat16]
    if not linears:
        return getattr(model, "fewrow", False)  # another layout, or done already
    reason = unavailable_reason()
    if reason is not None:
        warnings.warn(f"few-row bf16 products are unavailable ({reason}); using F.linear", stacklevel=2)
        return False
    for module in linears:
        module.packed = pack(module.weight)
        module.__class__ = FewRowLinear
    model.fewrow = True  # what speculative decoding's cost model reads (generation/speculative.forward_cost)
    return True
