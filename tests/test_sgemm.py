"""fp32 products of several rows through oneDNN where MKL is slow (kernels/sgemm.py).

oneDNN's product sums exact fp32 products in another order than MKL's: the bar is fp32 rounding of the exact
(fp64) product, which F.linear itself must meet. Every CPU runs both choices (sgemm.choose)."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from checkpoints import build_checkpoint
from test_widen import within_rounding

from qwen3_scratch.checkpoint.weights import load_model
from qwen3_scratch.kernels import sgemm, widen
from qwen3_scratch.kernels.matvec import MatvecLinear

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@pytest.mark.parametrize("rows,n,k", [(2, 96, 64), (16, 600, 128), (300, 33, 1024), (7, 1000, 40)])
def test_onednn_products_round_like_f_linear(rows, n, k):
    generator = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, k, generator=generator), torch.randn(n, k, generator=generator)
    bias = torch.randn(n, generator=generator)
    with sgemm.choose("onednn"):
        y = sgemm.linear(x, w, bias)
        out = torch.full((rows, 2 * n), float("nan"))[:, ::2]  # a strided view, as widen.products hands it
        assert sgemm.mm(x, w, out=out) is out
    assert y.dtype == torch.float32 and y.shape == (rows, n)
    assert within_rounding(y, x, w, torch.float32, bias)
    assert within_rounding(out, x, w, torch.float32)
    assert within_rounding(F.linear(x, w, bias), x, w, torch.float32, bias), "F.linear misses the bar: it is wrong"


def test_mkl_is_f_linear_itself_and_other_dtypes_keep_it():
    generator = torch.Generator().manual_seed(2)
    x, w = torch.randn(2, 5, 64, generator=generator), torch.randn(48, 64, generator=generator)
    with sgemm.choose("mkl"):
        assert torch.equal(sgemm.linear(x, w), F.linear(x, w))
        out = torch.empty(10, 48)
        assert torch.equal(sgemm.mm(x.view(10, 64), w, out=out), torch.mm(x.view(10, 64), w.t()))
    with sgemm.choose("onednn"):
        y = sgemm.linear(x, w)
        assert y.shape == (2, 5, 48), "leading dimensions are kept"
        assert within_rounding(y.view(10, 48), x.view(10, 64), w, torch.float32)
        assert torch.equal(sgemm.linear(x.bfloat16(), w.bfloat16()), F.linear(x.bfloat16(), w.bfloat16())), \
            "bf16 is not sgemm's"


def test_the_cpus_vendor_and_the_variable_decide(monkeypatch):
    def decided(vendor, variable=None):
        monkeypatch.setattr(sgemm, "cpu_vendor", lambda: vendor)
        if variable is None:
            monkeypatch.delenv("QWEN3_SCRATCH_SGEMM", raising=False)
        else:
            monkeypatch.setenv("QWEN3_SCRATCH_SGEMM", variable)
        sgemm.default_uses_onednn.cache_clear()
        return sgemm.uses_onednn()

    try:
        if torch.backends.mkl.is_available():
            assert decided("AuthenticAMD"), "MKL runs generic kernels on an AMD CPU"
        assert not decided("GenuineIntel"), "MKL's own kernels on an Intel CPU"
        assert not decided(""), "a CPU that names no vendor keeps F.linear"
        assert decided("GenuineIntel", "onednn") and not decided("AuthenticAMD", "mkl")
        with pytest.warns(UserWarning, match="QWEN3_SCRATCH_SGEMM='blas' is not one of mkl, onednn; ignored"):
            assert not decided("GenuineIntel", "blas")
        with sgemm.choose("onednn"):
            assert sgemm.uses_onednn(), "choose wins over the default"
            with sgemm.choose("mkl"):
                assert not sgemm.uses_onednn()
            assert sgemm.uses_onednn(), "and is undone at the block's end"
        with pytest.raises(ValueError, match="sgemm choice 'blas'"), sgemm.choose("blas"):
            pass
    finally:
        monkeypatch.undo()
        sgemm.default_uses_onednn.cache_clear()


def test_cpuinfo_names_the_vendor():
    vendor = sgemm.cpu_vendor()
    assert isinstance(vendor, str)
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return
    if "vendor_id" in text:
        assert vendor and f"vendor_id\t: {vendor}" in text


@pytest.mark.parametrize("rows", [20, sgemm.MKL_BLOCK_ROWS])
@pytest.mark.parametrize("choice", sgemm.CHOICES)
def test_widened_products_run_by_either_choice(monkeypatch, choice, rows):
    """widen.products' fp32 part runs through the chosen product (oneDNN's below MKL_BLOCK_ROWS rows only), within
    bf16 rounding of the exact one."""
    monkeypatch.setattr(widen, "cpu_has_native_bf16", lambda: False)
    generator = torch.Generator().manual_seed(9)
    x = torch.randn(rows, 96, generator=generator).bfloat16()
    w = torch.randn(widen.BLOCK_ROWS + 40, 96, generator=generator).bfloat16()
    calls = []
    real = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda *a: calls.append(a) or real(*a))
    with sgemm.choose(choice):
        y = widen.linear(x, w)
    onednn = choice == "onednn" and rows < sgemm.MKL_BLOCK_ROWS
    assert len(calls) == (2 if onednn else 0), "one oneDNN product a block, or none"
    assert within_rounding(y, x, w, torch.bfloat16)


def test_an_fp32_prompt_runs_through_onednn_with_the_plain_models_logits(tmp_path, monkeypatch):
    """A prompt through the CLI's layout in fp32 (MatvecLinear's several-row products) runs oneDNN's product, with
    the checkpoint's own layers' logits (F.linear, transformers' bits) within fp32 rounding, and MKL's exactly."""
    path = build_checkpoint(tmp_path)
    fast, plain = load_model(path, optimize="decode"), load_model(path)
    assert type(fast.lm_head) is MatvecLinear
    calls = []
    real = sgemm.linear
    monkeypatch.setattr(sgemm, "linear", lambda *a: calls.append(a) or real(*a))
    prompt = torch.arange(3, 3 + 12).view(1, -1)
    with torch.no_grad():
        reference = plain(prompt)
        with sgemm.choose("onednn"):
            ours = fast(prompt)
        with sgemm.choose("mkl"):
            assert torch.equal(fast(prompt), reference), "MKL's route is F.linear's bits"
    assert len(calls) >= 2 * len(fast.model.layers) * 4, "every product of the prompt went through sgemm"
    assert (ours.argmax(-1) == reference.argmax(-1)).all()
    assert (ours - reference).abs().max() <= 1e-4 * reference.abs().max(), "more than fp32 rounding apart"
