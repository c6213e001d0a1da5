"""One row's decode attention as one compiled kernel over the cache in place (kernels/one_row_attention.py):
the model's one-query maths within fp32 rounding, masked slots never attended, one compile for every length,
and a bf16 decode through it within the parity bounds. Its package (any length) is built and checked bit for bit
against this compiled kernel by tests/test_aot_kernels.py, with the other stored kernels; speed is in
scripts/bench/attention_ab.py."""

import pytest
import torch
from checkpoints import assert_logits_match, build_checkpoint, load_reference
from test_decode_layouts import GREEDY, assert_within_bf16_bounds_of_the_eager_layers, decode_logits, ids

from qwen3_scratch.checkpoint.weights import load_model
from qwen3_scratch.generation.loops import generate_tokens
from qwen3_scratch.kernels import aot, cpu_decode, one_row_attention
from qwen3_scratch.model.qwen3 import one_query_attention


@pytest.fixture
def stored_kernels_on(tmp_path, monkeypatch):
    """Stored kernels on, in an empty cache: decode attends by the kernel, compiled (as a first start does)."""
    monkeypatch.setenv("QWEN3_SCRATCH_AOT", "1")
    monkeypatch.setenv(aot.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(aot, "PENDING", {})
    monkeypatch.setattr(cpu_decode, "FLASH_ATTENTION", False)  # the route of a CPU without AMX, on any CPU
    one_row_attention.kernel.cache_clear()
    yield
    one_row_attention.kernel.cache_clear()


def inputs(H, K, D, L, S, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, H, 1, D, generator=g).to(dtype)
    keys, values = (torch.randn(1, K, L, D, generator=g).to(dtype) for _ in range(2))
    mask = torch.rand(1, 1, 1, S, generator=g) < 0.7
    mask[..., -1] = True  # the token's own slot
    return q, keys, values, mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_is_the_one_query_maths_over_the_widened_cache_and_compiles_once(dtype, stored_kernels_on):
    counters = torch._dynamo.utils.counters
    graphs = None
    for seed, (L, S) in enumerate([(9, 1), (40, 5), (64, 64), (300, 200), (1100, 1030)]):  # S == L too
        q, keys, values, mask = inputs(8, 2, 64, L, S, dtype, seed)
        got = one_row_attention.compiled(q, keys, values, mask)
        assert got.shape == (1, 1, 8 * 64) and got.dtype == dtype
        want = one_query_attention(q.float(), keys[:, :, :S].float(), values[:, :, :S].float(), mask).view(1, 1, -1)
        tolerance = 1e-5 if dtype == torch.float32 else 2**-7  # fp32 sums in another order; one bf16 rounding
        torch.testing.assert_close(got.float(), want, rtol=tolerance, atol=tolerance, msg=f"L={L}, S={S}")
        keys[:, :, S:], values[:, :, S:] = 1e4, 1e4  # slots past S, and the masked ones, must not count
        values[0, :, :S][:, ~mask.view(S)] = 1e4
        assert torch.equal(one_row_attention.compiled(q, keys, values, mask), got), f"masked slots attended (S={S})"
        graphs = graphs or counters["stats"]["unique_graphs"]
    assert counters["stats"]["unique_graphs"] == graphs, "the kernel compiled again for another length"


def test_bf16_decode_through_the_kernel_stays_within_the_parity_bounds(tmp_path, stored_kernels_on, monkeypatch):
    """A bf16 decode whose layers attend by the kernel: the eager layers' greedy choices and logits within bf16's
    rounding (it sums in fp32, they round scores to bf16), and transformers' greedy tokens."""
    path = build_checkpoint(tmp_path / "bf16", dtype=torch.bfloat16)
    model = load_model(path, dtype=torch.bfloat16, optimize="decode")
    calls = []
    monkeypatch.setattr(
        one_row_attention, "compiled", lambda *a: calls.append(a[3].shape[-1]) or one_row_attention._compiled()(*a)
    )
    one_row_attention.kernel.cache_clear()  # (its build check calls it once, on 3 slots)
    tokens = ids(1, 90, seed=6)[0].tolist()
    fast = decode_logits(model, tokens, prompt_len=20).float()  # 70 steps: 64, then all 90 slots attended
    steps = sum(slots >= 64 for slots in calls)
    assert steps == 70 * model.config.num_hidden_layers, f"the kernel ran {steps} times in decode steps"
    prompt = ids(1, 12, seed=3)
    ours = torch.cat(list(generate_tokens(model, prompt.tolist(), 16, GREEDY, ignore_eos=True))).tolist()
    assert_within_bf16_bounds_of_the_eager_layers(model, tokens, fast, "the one-row kernel")
    reference = load_reference(path, dtype=torch.bfloat16)
    theirs = reference.generate(prompt, max_new_tokens=16, min_new_tokens=16, do_sample=False)[0, 12:].tolist()
    assert ours == theirs, "bf16 greedy tokens through the kernel differ from transformers'"
    handed = [key["function"] for key in aot.PENDING.values()]
    assert f"{one_row_attention.__name__}:one_row_attention" in handed, f"not handed to the builder: {handed}"


def test_fp32_decode_through_the_kernel_matches_transformers(tmp_path, stored_kernels_on):
    """fp32 decode steps whose layers attend by the kernel: transformers' logits to the parity suite's bar."""
    path = build_checkpoint(tmp_path / "fp32")
    model = load_model(path, dtype=torch.float32, optimize="decode")
    x = ids(1, 80)
    reference = load_reference(path)(x).logits
    steps = decode_logits(model, x[0].tolist(), prompt_len=56)  # 24 steps: 64, then all 80 slots attended
    assert_logits_match(steps, reference[0, 55:], "decode steps through the one-row kernel")
    routed = [key for key in aot.PENDING.values() if key["function"].endswith(":one_row_attention")]
    assert routed and routed[0]["args"][0][1] == "float32", "the fp32 decode did not attend by the kernel"


def test_a_kernel_the_compiler_cannot_build_leaves_decode_on_torchs_ops(tmp_path, stored_kernels_on, monkeypatch):
    """No C++ compiler for this kernel (or a wrong build): one warning, and decode attends as without stored kernels."""
    path = build_checkpoint(tmp_path / "bf16", dtype=torch.bfloat16)
    model = load_model(path, dtype=torch.bfloat16, optimize="decode")
    prompt = ids(1, 12, seed=4).tolist()
    monkeypatch.setattr(cpu_decode, "ONE_ROW_KERNEL", False)
    plain = torch.cat(list(generate_tokens(model, prompt, 8, GREEDY, ignore_eos=True))).tolist()
    monkeypatch.setattr(cpu_decode, "ONE_ROW_KERNEL", True)

    def no_compiler(*args):
        raise RuntimeError("InvalidCxxCompiler: no working C++ compiler")

    monkeypatch.setattr(one_row_attention, "compiled", no_compiler)
    one_row_attention.kernel.cache_clear()
    with pytest.warns(UserWarning, match="one-row decode attention is unavailable .*InvalidCxxCompiler"):
        got = torch.cat(list(generate_tokens(model, prompt, 8, GREEDY, ignore_eos=True))).tolist()
    assert got == plain, "with the kernel unavailable, decode should attend as without it"
