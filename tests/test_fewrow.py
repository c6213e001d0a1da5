"""The few-row bf16 products (kernels/fewrow.py) round like F.linear, and a speculating target uses them.

Speculative decoding's verification forward sends k+1 rows through every matrix; fewrow.py gives each
matrix a copy packed for oneDNN, so the rows share one read of it. oneDNN's sums may run in another order
than F.linear's, so the bar is bf16 rounding: each output within half a bf16 ulp of the exact (fp64)
product of the same bf16 inputs, like F.linear's own."""

import re

import pytest
import torch
import torch.nn.functional as F
from checkpoints import build_checkpoint

from qwen3_scratch.checkpoint.weights import load_model
from qwen3_scratch.generation.conversation import ConversationCache
from qwen3_scratch.generation.speculative import make_speculator, products_of
from qwen3_scratch.kernels import fewrow as fewrow_module
from qwen3_scratch.kernels.cpu_decode import CPUDecoderLayer
from qwen3_scratch.kernels.fewrow import MAX_ROWS, SLOW_ROWS, FewRowDecoderLayer, FewRowLinear, fewrow, pack
from qwen3_scratch.kernels.matvec import MatvecLinear

REASON = fewrow_module.unavailable_reason()
needs_onednn_bf16 = pytest.mark.skipif(REASON is not None, reason=f"few-row bf16 products are unavailable: {REASON}")


def within_bf16_rounding(y, exact):
    """|y - exact| <= half an ulp of bf16 at exact's magnitude (2^-8 relative), plus a hair for the
    fp32 sum itself."""
    return bool(((y.double() - exact).abs() <= exact.abs() * 2**-8 * 1.001 + 1e-30).all())


@needs_onednn_bf16
@pytest.mark.parametrize("rows,n,k", [(2, 96, 64), (5, 160, 1024), (MAX_ROWS, 33, 72), (3, 7, 40)])
def test_few_row_product_rounds_like_f_linear(rows, n, k):
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=generator).bfloat16()
    w = torch.randn(n, k, generator=generator).bfloat16()
    exact = x.double() @ w.double().T  # (R, N)
    y, reference = fewrow(x, pack(w)), F.linear(x, w)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, n)
    assert within_bf16_rounding(y, exact), f"max error {(y.double() - exact).abs().max():.3g}"
    assert within_bf16_rounding(reference, exact), "F.linear itself misses the bar: the bar is wrong"


@needs_onednn_bf16
@pytest.mark.parametrize("rows", sorted(SLOW_ROWS))
def test_rows_run_padded_give_the_bits_of_the_same_rows_beside_real_ones(rows):
    """Padding with zero rows is safe only if a product's rows do not mix: the padded rows' outputs must be
    bit for bit those of the same rows multiplied beside other, nonzero rows."""
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(SLOW_ROWS[rows], 1024, generator=generator).bfloat16()
    packed = pack(torch.randn(384, 1024, generator=generator).bfloat16())
    assert torch.equal(fewrow(x[:rows], packed), fewrow(x, packed)[:rows])


@needs_onednn_bf16
def test_a_speculating_target_runs_few_rows_through_packed_copies_with_the_same_logits(tmp_path):
    path = build_checkpoint(tmp_path, dtype=torch.bfloat16)
    fast = load_model(path, dtype=torch.bfloat16, optimize="decode")
    plain = load_model(path, dtype=torch.bfloat16)
    keys = set(fast.state_dict())
    assert type(fast.lm_head) is MatvecLinear, "a model that does not speculate keeps no second copy"
    assert products_of(fast) == "F.linear"
    make_speculator("ngram", fast)
    assert isinstance(fast.lm_head, FewRowLinear) and isinstance(fast.model.layers[0].mlp.down_proj, FewRowLinear)
    assert all(type(layer) is FewRowDecoderLayer for layer in fast.model.layers)
    assert type(fast.model.layers[0].self_attn.q_proj) is MatvecLinear, "q/k/v are packed stacked, not one by one"
    assert products_of(fast) == "fewrow", "the adaptive k must use the packed products' costs"
    assert set(fast.state_dict()) == keys, "the packed copies are not part of the checkpoint's state"
    prompt, rows = list(range(3, 40)), [41, 42, 43, 44, 45]
    logits = []
    for model in (fast, plain):
        cache = ConversationCache(model)
        cache.prefill(prompt)
        logits.append(cache.extend(rows).float())  # (5, V): the verification forward's shape
        logits.append(cache.extend(rows[:2]).float())  # 2 rows: run padded to 3
    for ours, reference in zip(logits[:2], logits[2:]):
        assert (ours.argmax(-1) == reference.argmax(-1)).all()
        assert (ours - reference).abs().max() <= 0.05 * reference.abs().max(), "more than bf16 rounding apart"


def test_fp32_models_keep_the_one_row_loop_and_f_linear(tmp_path):
    model = load_model(build_checkpoint(tmp_path), optimize="decode")
    make_speculator("ngram", model)
    assert type(model.lm_head) is MatvecLinear, "the packed few-row products are bf16 only"


def exact_product(x, weight, bias=None):
    """x (R, K) times weight (N, K) transposed, summed exactly and rounded once: the same bits whichever columns are
    computed together."""
    return (x.double() @ weight.double().T).to(x.dtype)


def test_a_verification_layer_gives_the_bits_of_the_layers_own_forward_over_the_same_products(tmp_path, monkeypatch):
    """FewRowDecoderLayer runs q/k/v as one packed product, gate/up as one, and q's and k's heads normed and rotated
    together. Each is the model's maths per row and per head, so over products that give the same bits whichever
    columns go together (exact sums, rounded once: oneDNN's own may pick another kernel for another width) its
    logits must equal the same layer's own forward (CPUDecoderLayer: the modules one by one) bit for bit, at
    every row count a verification has; one row, and more rows than MAX_ROWS, fall back to that forward."""
    monkeypatch.setattr(fewrow_module, "pack", lambda weight: weight.detach().clone())
    monkeypatch.setattr(fewrow_module, "fewrow", exact_product)
    monkeypatch.setattr(fewrow_module, "unavailable_reason", lambda: None)
    model = load_model(build_checkpoint(tmp_path, dtype=torch.bfloat16), dtype=torch.bfloat16, optimize="decode")
    make_speculator("ngram", model)
    layers = model.model.layers
    assert all(type(layer) is FewRowDecoderLayer for layer in layers)
    stacked = [m for layer in layers for m in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                                               layer.mlp.gate_proj, layer.mlp.up_proj)]  # fmt: skip
    for module in stacked:  # the reference's products: the same exact ones, one matrix at a time
        module.packed = module.weight
    cache = ConversationCache(model)
    cache.prefill(list(range(3, 40)))
    for rows in [1, 2, 3, 5, MAX_ROWS, MAX_ROWS + 1]:
        logits = []
        for layer_class, linear_class in ((FewRowDecoderLayer, MatvecLinear), (CPUDecoderLayer, FewRowLinear)):
            for layer in layers:
                layer.__class__ = layer_class
            for module in stacked:
                module.__class__ = linear_class
            logits.append(cache.extend(list(range(50, 50 + rows))))
            cache.truncate(37)
        assert logits[0].shape[0] == rows and torch.equal(logits[0], logits[1]), f"{rows} rows"
    packed = layers[0].qkv_packed
    make_speculator("ngram", model)
    assert layers[0].qkv_packed is packed, "a second speculator packs nothing again"


def test_copies_that_would_not_fit_beside_the_model_are_not_made(tmp_path, monkeypatch):
    """Qwen3-8B's packed copies (16 GB) beside its matrices on a 24 GB machine would push the weights the one-row
    steps read out of memory: then no copy is made, with a warning that says why, and speculation verifies through
    F.linear (the cost model it uses says so)."""
    model = load_model(build_checkpoint(tmp_path, dtype=torch.bfloat16), dtype=torch.bfloat16, optimize="decode")
    matrices = sum(m.weight.nbytes for m in model.modules() if type(m) is MatvecLinear)
    monkeypatch.setattr(fewrow_module, "available_memory", lambda: 2 * matrices - 1)
    needle = r"packed copies need [\d.]+ GiB, and the model's matrices as much again; [\d.]+ GiB of memory is available"
    assert re.search(needle, fewrow_module.too_big_reason(matrices))
    assert fewrow_module.too_big_reason(matrices - 1) is None
    if REASON is not None:  # a CPU without oneDNN's bf16 kernels (AVX2 only) never gets as far as the memory
        needle = re.escape(REASON)
    with pytest.warns(UserWarning, match=needle):
        assert make_speculator("ngram", model) is not None
    assert type(model.lm_head) is MatvecLinear and products_of(model) == "F.linear"
    monkeypatch.setattr(fewrow_module, "available_memory", lambda: 2 * matrices)
    if REASON is None:
        make_speculator("ngram", model)
        assert products_of(model) == "fewrow", "room for both: the copies are made"
