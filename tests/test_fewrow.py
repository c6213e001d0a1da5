"""The few-row bf16 product (kernels/fewrow.py) equals F.linear, and the decode layout uses it.

Speculative decoding's verification forward sends k+1 rows through every matrix; this kernel makes
them share one read of the weights. Its sums run in another order than oneDNN's, so the bar is bf16
rounding: each output within half a bf16 ulp of the exact (fp64) product of the same bf16 inputs,
like F.linear's own."""

import pytest
import torch
import torch.nn.functional as F
from checkpoints import build_checkpoint

from qwen3_scratch.checkpoint.weights import load_model
from qwen3_scratch.generation.conversation import ConversationCache
from qwen3_scratch.kernels import fewrow as fewrow_module
from qwen3_scratch.kernels.fewrow import MAX_ROWS, FewRowLinear, fewrow
from qwen3_scratch.kernels.matvec import MatvecLinear

REASON = fewrow_module.unavailable_reason()
needs_kernel = pytest.mark.skipif(REASON is not None, reason=f"the few-row kernel is unavailable: {REASON}")


def within_bf16_rounding(y, exact):
    """|y - exact| <= half an ulp of bf16 at exact's magnitude (2^-8 relative), plus a hair for the
    fp32 sum itself."""
    return bool(((y.double() - exact).abs() <= exact.abs() * 2**-8 * 1.001 + 1e-30).all())


@needs_kernel
@pytest.mark.parametrize("rows,n,k", [(2, 96, 64), (5, 160, 1024), (MAX_ROWS, 33, 72), (3, 7, 40)])
def test_few_row_product_rounds_like_f_linear(rows, n, k):
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=generator).bfloat16()
    w = torch.randn(n, k, generator=generator).bfloat16()
    exact = x.double() @ w.double().T  # (R, N)
    y, reference = fewrow(x, w), F.linear(x, w)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, n)
    assert within_bf16_rounding(y, exact), f"max error {(y.double() - exact).abs().max():.3g}"
    assert within_bf16_rounding(reference, exact), "F.linear itself misses the bar: the bar is wrong"


@needs_kernel
def test_the_decode_layout_runs_few_rows_through_the_kernel_with_the_same_logits(tmp_path):
    path = build_checkpoint(tmp_path, dtype=torch.bfloat16)
    fast = load_model(path, dtype=torch.bfloat16, optimize="decode")
    plain = load_model(path, dtype=torch.bfloat16)
    assert isinstance(fast.lm_head, FewRowLinear) and isinstance(fast.model.layers[0].mlp.down_proj, FewRowLinear)
    prompt, rows = list(range(3, 40)), [41, 42, 43, 44, 45]
    logits = []
    for model in (fast, plain):
        cache = ConversationCache(model)
        cache.prefill(prompt)
        logits.append(cache.extend(rows).float())  # (5, V): the verification forward's shape
    assert (logits[0].argmax(-1) == logits[1].argmax(-1)).all()
    assert (logits[0] - logits[1]).abs().max() <= 0.05 * logits[1].abs().max(), "more than bf16 rounding apart"


def test_fp32_models_keep_the_one_row_loop_and_f_linear(tmp_path):
    model = load_model(build_checkpoint(tmp_path), optimize="decode")
    assert type(model.lm_head) is MatvecLinear, "the few-row kernel is bf16 only"
