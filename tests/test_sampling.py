"""Sampling: each filter alone, their composition, agreement with transformers' warpers, the draw's
statistics and reproducibility, refusals of impossible settings, and generation_config.json defaults."""

import json
import math

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from qwen3_scratch.cli.flags import FLAGS
from qwen3_scratch.errors import GenerationError, Qwen3Error
from qwen3_scratch.sampling.defaults import load_generation_config
from qwen3_scratch.sampling.logits import (
    LogitsFilter,
    apply_temperature,
    filter_logits,
    min_p_filter,
    sample,
    top_k_filter,
    top_p_filter,
)
from qwen3_scratch.sampling.params import SamplingParams, check_fields

# Qwen3-0.6B's generation_config.json as the Hub ships it.
QWEN3_GENERATION_CONFIG = {
    "bos_token_id": 151643,
    "do_sample": True,
    "eos_token_id": [151645, 151643],
    "pad_token_id": 151643,
    "temperature": 0.6,
    "top_k": 20,
    "top_p": 0.95,
    "transformers_version": "4.51.0",
}


def random_logits(rows=4, vocab=50, seed=0, scale=3.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def logits_from_probs(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs).log()[None]  # (1, V)


def kept(filtered: torch.Tensor) -> list[list[int]]:
    """Token ids a filter left finite, per row."""
    return [torch.nonzero(torch.isfinite(row)).flatten().tolist() for row in filtered]


def draw_many(logits: torch.Tensor, params: LogitsFilter, draws: int, seed: int) -> torch.Tensor:
    """(draws, B) tokens: every row of logits sampled `draws` times in one call."""
    generator = torch.Generator().manual_seed(seed)
    return sample(logits.repeat(draws, 1), params, generator).view(draws, logits.shape[0])


# --- greedy -----------------------------------------------------------------------------------------


def test_temperature_zero_is_argmax_for_every_row():
    logits = random_logits(rows=6, vocab=100)
    tokens = sample(logits, LogitsFilter(temperature=0.0, top_k=5, top_p=0.5, min_p=0.2))
    assert torch.equal(tokens, logits.argmax(dim=-1)), "temperature 0 must be argmax, ignoring the filters"


def test_greedy_ignores_the_generator():
    logits = random_logits(rows=3)
    a = sample(logits, LogitsFilter(temperature=0), torch.Generator().manual_seed(1))
    b = sample(logits, LogitsFilter(temperature=0), torch.Generator().manual_seed(2))
    assert torch.equal(a, b), "greedy decoding must not depend on the seed"


# --- the draw ---------------------------------------------------------------------------------------


def test_sample_returns_long_ids_of_shape_batch_on_the_logits_device():
    tokens = sample(random_logits(rows=5), LogitsFilter(), torch.Generator().manual_seed(0))
    assert tokens.shape == (5,) and tokens.dtype == torch.long and tokens.device.type == "cpu", tokens


@pytest.mark.parametrize("params", [LogitsFilter(), LogitsFilter(0.7, 5, 0.9, 0.05), LogitsFilter(0)])
def test_sample_never_reads_tensor_values_on_the_host(params):
    # A meta tensor has a shape but no data: any .item(), .tolist() or `if tensor:` would raise.
    # This is how we prove the decode loop never waits for the GPU inside sample().
    logits = torch.empty(3, 1000, device="meta", dtype=torch.bfloat16)
    tokens = sample(logits, params)
    assert tokens.shape == (3,) and tokens.dtype == torch.long and tokens.device.type == "meta", tokens


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_sample_on_cuda_never_synchronises():
    logits = torch.randn(4, 151_936, device="cuda", dtype=torch.bfloat16)
    generator = torch.Generator("cuda").manual_seed(0)
    params = LogitsFilter(temperature=0.6, top_k=20, top_p=0.95, min_p=0.01)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any device-to-host wait now raises
    try:
        tokens = sample(logits, params, generator)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert tokens.shape == (4,) and tokens.device.type == "cuda" and tokens.dtype == torch.long


def test_same_seed_gives_same_tokens():
    logits = random_logits(rows=4, vocab=1000, scale=1.0)
    a = draw_many(logits, LogitsFilter(), draws=50, seed=123)
    b = draw_many(logits, LogitsFilter(), draws=50, seed=123)
    assert torch.equal(a, b), "the same generator seed must reproduce the same tokens"


def test_different_seeds_give_different_draws():
    logits = random_logits(rows=4, vocab=1000, scale=1.0)
    a = draw_many(logits, LogitsFilter(), draws=50, seed=1)
    b = draw_many(logits, LogitsFilter(), draws=50, seed=2)
    agree = (a == b).float().mean().item()
    assert agree < 0.5, f"seeds 1 and 2 agreed on {agree:.0%} of 200 near-uniform draws; is the generator used?"


def test_draw_frequencies_match_softmax_of_logits_over_temperature():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    temperature, draws = 0.7, 200_000
    tokens = draw_many(logits, LogitsFilter(temperature=temperature), draws, seed=7).flatten()
    observed = torch.bincount(tokens, minlength=5).double()
    expected = (logits[0].double() / temperature).softmax(-1) * draws
    chi_square = ((observed - expected) ** 2 / expected).sum().item()
    # 18.47 is the 99.9th percentile of chi-square with 4 degrees of freedom
    assert chi_square < 18.47, f"observed {observed.tolist()} vs expected {expected.tolist()}: chi2 {chi_square:.1f}"


def test_filtered_tokens_are_never_drawn():
    logits = random_logits(rows=4, vocab=200)
    params = LogitsFilter(temperature=1.3, top_k=5)
    tokens = draw_many(logits, params, draws=2000, seed=3)  # (2000, 4)
    allowed = logits.topk(5, dim=-1).indices  # (4, 5)
    inside = (tokens[:, :, None] == allowed[None]).any(-1)
    assert inside.all(), f"{(~inside).sum().item()} of 8000 draws fell outside the top 5 logits"


# --- each filter alone ------------------------------------------------------------------------------


def test_temperature_divides_logits_and_one_is_a_no_op():
    logits = random_logits()
    assert torch.allclose(apply_temperature(logits, 0.5), logits * 2)
    assert apply_temperature(logits, 1.0) is logits, "temperature 1 should not copy the logits"


def test_top_k_keeps_exactly_the_k_highest_logits():
    logits = random_logits(rows=3, vocab=30)
    expected = [sorted(row.topk(4).indices.tolist()) for row in logits]
    assert kept(top_k_filter(logits, 4)) == expected


def test_top_k_zero_or_larger_than_vocab_is_off():
    logits = random_logits()
    assert top_k_filter(logits, 0) is logits and top_k_filter(logits, 10_000) is logits


def test_top_k_keeps_every_token_tied_with_the_kth():
    logits = torch.tensor([[3.0, 2.0, 2.0, 1.0]])
    assert kept(top_k_filter(logits, 2)) == [[0, 1, 2]], "ties with the k-th logit are kept, as transformers does"


@pytest.mark.parametrize(
    "p, expected",
    [
        (0.49, [0]),  # the top token alone already reaches p
        (0.5, [0]),  # exactly reaching p is enough
        (0.51, [0, 1]),
        (0.8, [0, 1]),  # 0.5 + 0.3 reaches 0.8 exactly
        (0.81, [0, 1, 2]),
        (0.95, [0, 1, 2]),
        (0.96, [0, 1, 2, 3]),
        (1e-9, [0]),  # the top token always survives
    ],
)
def test_top_p_keeps_the_smallest_set_reaching_p(p, expected):
    logits = logits_from_probs([0.5, 0.3, 0.15, 0.05])
    assert kept(top_p_filter(logits, p)) == [expected], f"probs [0.5, 0.3, 0.15, 0.05], top_p={p}"


def test_top_p_boundary_follows_exact_arithmetic_not_rounding():
    # float32 computes 0.4 + 0.3 + 0.2 as 0.8999999762, just under 0.9; the set still reaches 0.9
    logits = logits_from_probs([0.4, 0.3, 0.2, 0.1])
    assert kept(top_p_filter(logits, 0.9)) == [[0, 1, 2]]


def test_top_p_works_on_unsorted_vocab_order():
    logits = logits_from_probs([0.05, 0.3, 0.15, 0.5])
    assert kept(top_p_filter(logits, 0.8)) == [[1, 3]]


def test_top_p_breaks_ties_by_lower_token_id():
    logits = logits_from_probs([0.25, 0.25, 0.25, 0.25])
    assert kept(top_p_filter(logits, 0.5)) == [[0, 1]], "of equally likely tokens, the lower ids are kept first"


def test_top_p_one_is_off():
    logits = random_logits()
    assert top_p_filter(logits, 1.0) is logits


def test_min_p_drops_exactly_the_tokens_below_min_p_times_the_top_probability():
    logits = logits_from_probs([0.5, 0.3, 0.12, 0.08])
    # threshold = 0.2 x 0.5 = 0.1: 0.12 stays, 0.08 goes
    assert kept(min_p_filter(logits, 0.2)) == [[0, 1, 2]]
    # threshold = 0.7 x 0.5 = 0.35: only the top token stays
    assert kept(min_p_filter(logits, 0.7)) == [[0]]


def test_min_p_zero_is_off():
    logits = random_logits()
    assert min_p_filter(logits, 0.0) is logits


def test_filters_keep_the_surviving_logits_unchanged():
    logits = random_logits()
    for filtered in (top_k_filter(logits, 5), top_p_filter(logits, 0.7), min_p_filter(logits, 0.1)):
        survivors = torch.isfinite(filtered)
        assert torch.equal(filtered[survivors], logits[survivors]), "a filter may only remove tokens"


# --- composition ------------------------------------------------------------------------------------


def test_top_k_then_top_p_keeps_at_most_k():
    logits = random_logits(rows=8, vocab=100, scale=0.5)  # flat: top-p alone would keep dozens
    filtered = filter_logits(logits, LogitsFilter(top_k=3, top_p=0.99))
    counts = torch.isfinite(filtered).sum(-1)
    assert (counts <= 3).all(), f"kept counts per row {counts.tolist()}"


def test_top_p_applies_after_top_k_renormalises():
    # after top-k=2 the probabilities are 0.625 and 0.375, so top_p=0.6 keeps only the first
    logits = logits_from_probs([0.5, 0.3, 0.15, 0.05])
    assert kept(filter_logits(logits, LogitsFilter(top_k=2, top_p=0.6))) == [[0]]


def test_temperature_applies_before_min_p():
    # at t=1 the second token has ratio 0.6 > 0.5 and survives; at t=0.5 its ratio is 0.36 and it goes
    logits = logits_from_probs([0.5, 0.3, 0.2])
    assert kept(filter_logits(logits, LogitsFilter(min_p=0.5))) == [[0, 1]]
    assert kept(filter_logits(logits, LogitsFilter(temperature=0.5, min_p=0.5))) == [[0]]


# --- agreement with transformers ---------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(3))
def test_each_filter_keeps_the_same_tokens_as_transformers(seed):
    logits = random_logits(rows=8, vocab=500, seed=seed)
    ids = torch.zeros(8, 1, dtype=torch.long)  # warpers take input_ids but these ignore them
    pairs = [
        (top_k_filter(logits, 17), TopKLogitsWarper(17)(ids, logits)),
        (top_p_filter(logits, 0.9), TopPLogitsWarper(0.9)(ids, logits)),
        (top_p_filter(logits, 0.3), TopPLogitsWarper(0.3)(ids, logits)),
        (min_p_filter(logits, 0.05), MinPLogitsWarper(0.05)(ids, logits)),
    ]
    for ours, theirs in pairs:
        assert kept(ours) == kept(theirs), "our filter kept a different set of tokens than transformers'"
    assert torch.allclose(apply_temperature(logits, 0.6), TemperatureLogitsWarper(0.6)(ids, logits))


def test_composed_filters_match_transformers_chain():
    logits = random_logits(rows=8, vocab=500, seed=5)
    ids = torch.zeros(8, 1, dtype=torch.long)
    theirs = logits
    for warper in (TemperatureLogitsWarper(0.7), TopKLogitsWarper(40), TopPLogitsWarper(0.8), MinPLogitsWarper(0.1)):
        theirs = warper(ids, theirs)
    ours = filter_logits(logits, LogitsFilter(temperature=0.7, top_k=40, top_p=0.8, min_p=0.1))
    assert kept(ours) == kept(theirs), "temperature -> top-k -> top-p -> min-p must match transformers' order"
    assert torch.allclose(ours[torch.isfinite(ours)], theirs[torch.isfinite(theirs)])


# --- impossible settings ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "settings, flag",
    [
        ({"temperature": -0.1}, "--temperature"),
        ({"temperature": float("inf")}, "--temperature"),
        ({"temperature": float("nan")}, "--temperature"),
        ({"top_k": -1}, "--top-k"),
        ({"top_p": 0.0}, "--top-p"),
        ({"top_p": 1.5}, "--top-p"),
        ({"top_p": float("nan")}, "--top-p"),
        ({"min_p": -0.1}, "--min-p"),
        ({"min_p": 1.0}, "--min-p"),
    ],
)
def test_impossible_settings_raise_naming_the_flag(settings, flag):
    with pytest.raises(GenerationError, match=flag) as info:
        LogitsFilter(**settings)
    assert "\n" not in str(info.value), "errors are one line for the CLI"


def test_impossible_value_raises_naming_the_field_or_the_flag():
    with pytest.raises(GenerationError, match="top_p must be in \\(0, 1\\], got 1.5"):
        SamplingParams(top_p=1.5)
    with pytest.raises(GenerationError, match="--top-p must be in \\(0, 1\\], got 1.5"):
        check_fields({"top_p": 1.5}, FLAGS)  # the CLI checks its flags by the same table


def resolve(defaults: dict, **given) -> LogitsFilter:
    """The filter a request with these fields gets, the rest from the checkpoint's defaults."""
    return SamplingParams(**given).with_defaults(defaults).logits_filter


# --- generation_config.json -------------------------------------------------------------------------


def write_generation_config(folder, content) -> None:
    text = content if isinstance(content, str) else json.dumps(content)
    (folder / "generation_config.json").write_text(text)


def test_qwen3_generation_config_is_read(tmp_path):
    write_generation_config(tmp_path, QWEN3_GENERATION_CONFIG)
    defaults = load_generation_config(tmp_path)
    expected = {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "do_sample": True, "eos_token_id": [151645, 151643]}
    assert defaults == expected
    assert resolve(defaults) == LogitsFilter(temperature=0.6, top_k=20, top_p=0.95)


def test_single_eos_id_becomes_a_list_and_lengths_are_read(tmp_path):
    write_generation_config(tmp_path, {"eos_token_id": 2, "max_new_tokens": 64, "max_length": 512, "top_k": None})
    assert load_generation_config(tmp_path) == {"eos_token_id": [2], "max_new_tokens": 64, "max_length": 512}


def test_flags_override_the_checkpoint_one_by_one(tmp_path):
    write_generation_config(tmp_path, QWEN3_GENERATION_CONFIG)
    defaults = load_generation_config(tmp_path)
    params = resolve(defaults, temperature=1.0, top_p=0.5)
    assert params == LogitsFilter(temperature=1.0, top_k=20, top_p=0.5), "unset flags keep the checkpoint's"
    assert resolve(defaults, top_k=0).top_k == 0, "0 is a real value (off), not 'unset'"
    assert resolve(defaults, temperature=0).greedy


def test_do_sample_false_means_greedy_unless_a_temperature_flag_is_given(tmp_path):
    write_generation_config(tmp_path, {"do_sample": False, "temperature": 0.6, "top_k": 20})
    defaults = load_generation_config(tmp_path)
    assert resolve(defaults).greedy
    assert resolve(defaults, temperature=0.8) == LogitsFilter(temperature=0.8, top_k=20)


def test_no_generation_config_gives_sampling_defaults(tmp_path):
    assert load_generation_config(tmp_path) == {}
    assert resolve({}) == LogitsFilter()


def test_malformed_generation_config_raises_naming_the_file(tmp_path):
    write_generation_config(tmp_path, '{"temperature": 0.6,')
    with pytest.raises(Qwen3Error, match="generation_config.json"):
        load_generation_config(tmp_path)


@pytest.mark.parametrize(
    "content, key",
    [
        ([1, 2], "JSON object"),
        ({"top_p": 2.0}, "top_p"),
        ({"top_k": "20"}, "top_k"),
        ({"do_sample": "yes"}, "do_sample"),
        ({"eos_token_id": ["</s>"]}, "eos_token_id"),
    ],
)
def test_impossible_checkpoint_values_raise_naming_file_and_key(tmp_path, content, key):
    write_generation_config(tmp_path, content)
    with pytest.raises(GenerationError, match=f"generation_config.json.*{key}"):
        load_generation_config(tmp_path)


@pytest.mark.parametrize("vocab", [1000, 1024, 151936])  # 1000: torch's argmax; multiples of 128: by blocks
def test_greedy_draw_equals_argmax_of_the_widened_logits_with_the_isfinite_check(vocab):
    """sampling.logits.greedy reads the row fewer times than `isfinite(...).all()` + argmax, and on a CPU finds
    the argmax by blocks of ids; same ids, first index on ties (bf16 logits tie often, across blocks too),
    NON_FINITE exactly for rows with a NaN or an infinity anywhere."""
    from qwen3_scratch.sampling.logits import ARGMAX_BLOCK, NON_FINITE, argmax_by_blocks, greedy

    logits = torch.randn(14, vocab, generator=torch.Generator().manual_seed(3)).mul(4).round().to(torch.bfloat16)
    for row, (index, bad) in enumerate([(0, "nan"), (999, "inf"), (5, "-inf"), (500, "nan")], start=1):
        logits[row * 2, index] = float(bad)
    logits[11] = float("-inf")
    logits[12] = 0.0  # every id ties: the first
    logits[13, [vocab - 1, 130, 3]] = 100.0  # the largest in three blocks: the first of them
    reference = torch.where(torch.isfinite(logits).all(-1), logits.float().argmax(-1), NON_FINITE)
    assert torch.equal(greedy(logits), reference), f"greedy {greedy(logits).tolist()} != {reference.tolist()}"
    assert greedy(logits)[13] == 3
    if vocab % ARGMAX_BLOCK == 0:
        wide = logits.float()
        tokens, best = argmax_by_blocks(wide)
        assert torch.equal(tokens, wide.argmax(-1)), "the argmax by blocks differs from torch's, NaN rows included"
        torch.testing.assert_close(best, wide.amax(-1), rtol=0, atol=0, equal_nan=True,
                                   msg="the largest value by blocks differs from amax")  # fmt: skip


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])])  # fmt: skip
def test_the_races_noise_is_exponential_and_never_zero(device):
    """exponential_noise (-log(1 - U), faster on a CPU than torch's exponential_) is Exponential(1): its mean,
    and P(E > t) = exp(-t), within a few standard errors of 200,000 draws; no draw is 0."""
    from qwen3_scratch.sampling.logits import exponential_noise

    noise = exponential_noise(torch.empty(200_000, device=device), torch.Generator(device).manual_seed(0))
    assert noise.min() > 0 and torch.isfinite(noise).all()
    assert abs(noise.mean().item() - 1) < 5 * (1 / 200_000) ** 0.5, "Exponential(1) has mean 1, sd 1"
    for t in (0.1, 1.0, 3.0):
        share, p = (noise > t).float().mean().item(), math.exp(-t)
        assert abs(share - p) < 5 * (p * (1 - p) / 200_000) ** 0.5, f"P(E > {t}) = {share:.4f}, not {p:.4f}"


def test_top_p_among_the_top_k_survivors_equals_the_two_filters_bit_for_bit():
    """filter_logits' CPU path (top_k_then_top_p) ranks only the top-k survivors; it must keep exactly what
    top_p_filter(top_k_filter(...)) keeps, ties at the k-th and inside the nucleus included."""
    from qwen3_scratch.sampling.logits import top_k_then_top_p

    g = torch.Generator().manual_seed(1)
    for trial in range(150):
        x = torch.randn(4, int(torch.randint(70, 2000, (1,), generator=g)), generator=g) * 3
        if trial % 3 == 0:
            x = x.round()  # many ties
        if trial % 5 == 0:
            x[:, :50] = 7.0  # more tokens tied at the top than k
        k, p = int(torch.randint(1, 60, (1,), generator=g)), float(torch.rand(1, generator=g)) * 0.99 + 0.005
        expected = top_p_filter(top_k_filter(x, k), p)
        assert torch.equal(top_k_then_top_p(x, k, p), expected), f"trial {trial}: k={k}, p={p:.3f}"
