"""Products of many bf16 rows in fp32 on a CPU without bf16 instructions (kernels/widen.py).

The widened product sums exact fp32 products of the same bf16 (or fp16) inputs, in another order than torch's
kernels, then rounds once: the bar is the half-precision rounding of the exact (fp64) product, as for F.linear
itself. Every CPU runs these tests: where the CPU has bf16 instructions, the tests say it has none."""

import pytest
import torch
import torch.nn.functional as F
from checkpoints import build_checkpoint

from qwen3_scratch.checkpoint.weights import load_model
from qwen3_scratch.kernels import widen
from qwen3_scratch.kernels.matvec import MatvecLinear
from qwen3_scratch.kernels.widen import BLOCK_ROWS, MIN_ROWS, WideLinear


def within_rounding(y, x, w, dtype, bias=None):
    """|y - exact| <= half an ulp of dtype at the exact product's magnitude, plus what an fp32 sum of K terms can
    miss by (K ulps of fp32 of the sum of the terms' sizes: it matters where the terms cancel), plus half the
    spacing of dtype's subnormals. exact: the fp64 product of the same half-precision inputs."""
    exact = x.double() @ w.double().T + (0 if bias is None else bias.double())
    finfo, k = torch.finfo(dtype), w.shape[1]
    sum_error = (x.double().abs() @ w.double().abs().T) * k * 2**-24
    bound = exact.abs() * finfo.eps / 2 + sum_error + finfo.smallest_normal * finfo.eps / 2
    return bool(((y.double() - exact).abs() <= bound).all())


@pytest.fixture
def no_bf16_instructions(monkeypatch):
    monkeypatch.setattr(widen, "cpu_has_native_bf16", lambda: False)


@pytest.mark.parametrize("rows,n,k,dtype", [(MIN_ROWS, 96, 64, torch.bfloat16),
                                            (40, BLOCK_ROWS * 2 + 37, 72, torch.bfloat16),  # blocks and a part
                                            (300, 33, 1024, torch.bfloat16),
                                            (17, 600, 128, torch.float16)])  # fmt: skip
def test_widened_products_round_like_f_linear(rows, n, k, dtype):
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=generator).to(dtype)
    w = torch.randn(n, k, generator=generator).to(dtype)
    y = widen.linear(x, w)
    assert y.dtype == dtype and y.shape == (rows, n)
    assert within_rounding(y, x, w, dtype)
    assert within_rounding(F.linear(x, w), x, w, dtype), "F.linear itself misses the bar: the bar is wrong"


def test_a_bias_and_leading_dimensions_are_kept():
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(2, 9, 64, generator=generator).bfloat16()  # (B, T, K)
    w, bias = torch.randn(48, 64, generator=generator).bfloat16(), torch.randn(48, generator=generator).bfloat16()
    y = widen.linear(x, w, bias)
    assert y.shape == (2, 9, 48) and y.dtype == torch.bfloat16
    assert within_rounding(y.view(-1, 48), x.view(-1, 64), w, torch.bfloat16, bias)


def test_only_many_half_precision_rows_on_a_cpu_without_bf16_instructions_are_widened(monkeypatch):
    w = torch.zeros(16, 64, dtype=torch.bfloat16)
    many, few = torch.zeros(MIN_ROWS, 64, dtype=torch.bfloat16), torch.zeros(MIN_ROWS - 1, 64, dtype=torch.bfloat16)
    monkeypatch.setattr(widen, "cpu_has_native_bf16", lambda: False)
    assert widen.widens(many, w) and widen.widens(many.view(2, -1, 64), w)
    assert not widen.widens(few, w), "a few rows run torch's kernel"
    assert not widen.widens(many.float(), w.float()), "fp32 is fp32 already"
    monkeypatch.setattr(widen, "cpu_has_native_bf16", lambda: True)
    assert not widen.widens(many, w), "a CPU with bf16 instructions multiplies bf16 itself"


def count_widened(monkeypatch) -> list:
    calls = []
    real = widen.linear
    monkeypatch.setattr(widen, "linear", lambda *args: calls.append(args[1].shape) or real(*args))
    return calls


@pytest.mark.parametrize("layout", ["decode", "batch"])
def test_a_prompt_runs_widened_with_the_plain_models_logits(tmp_path, monkeypatch, no_bf16_instructions, layout):
    """A prompt through the CLI's layout (matvec.MatvecLinear) and the engine's (WideLinear) runs its products
    widened, with the logits of the checkpoint's own layers within bf16 rounding."""
    path = build_checkpoint(tmp_path, dtype=torch.bfloat16)
    fast = load_model(path, dtype=torch.bfloat16, optimize=layout)
    plain = load_model(path, dtype=torch.bfloat16)
    assert type(fast.lm_head) is (MatvecLinear if layout == "decode" else WideLinear)
    calls = count_widened(monkeypatch)
    prompt = torch.arange(3, 3 + 2 * MIN_ROWS).view(1, -1)
    with torch.no_grad():
        ours, reference = fast(prompt).float(), plain(prompt).float()
    assert len(calls) >= len(fast.model.layers) * 4 + 1, "every product of the prompt runs widened"
    assert (ours.argmax(-1) == reference.argmax(-1)).all()
    assert (ours - reference).abs().max() <= 0.05 * reference.abs().max(), "more than bf16 rounding apart"


def test_models_that_gain_nothing_keep_their_products(tmp_path, monkeypatch):
    """fp32 models, and bf16 ones on a CPU with bf16 instructions, get no WideLinear."""
    assert not any(isinstance(m, WideLinear) for m in load_model(build_checkpoint(tmp_path / "fp32"),
                                                                 optimize="batch").modules())  # fmt: skip
    monkeypatch.setattr(widen, "cpu_has_native_bf16", lambda: True)
    model = load_model(build_checkpoint(tmp_path / "bf16", dtype=torch.bfloat16), dtype=torch.bfloat16, optimize="batch")
    assert not any(isinstance(m, WideLinear) for m in model.modules())
