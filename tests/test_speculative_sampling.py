"""Sampled speculative decoding draws from the target's distribution, whatever the proposer proposes.

A chi-square test on a tiny vocabulary: the first token a round produces (a kept proposal, or the
replacement drawn after a rejection) must be distributed as the target's own next-token distribution
p, after the request's filters. The proposers disagree with the target often (a draft model whose
distribution q is far from p; proposals made with certainty, as prompt lookup makes them), and each
test first shows that its sample size would reject q, so the test can fail.

Deterministic: fixed seeds, so each test gives the same counts every run. The threshold is a p-value
of 1e-6: a correct implementation fails with probability one in a million per test (for the fixed
seeds here, it passes or fails once and for all; a change of seed is a new one-in-a-million draw).
"""

import pytest
import torch

from qwen3_scratch.generation.conversation import ConversationCache
from qwen3_scratch.generation.draft_model import DraftModel
from qwen3_scratch.generation.speculative import speculate
from qwen3_scratch.model.config import Qwen3Config
from qwen3_scratch.model.qwen3 import Qwen3
from qwen3_scratch.sampling.logits import LogitsFilter
from qwen3_scratch.sampling.rejection import distribution, draw, verify_sampled

P_VALUE = 1e-6


@pytest.fixture(autouse=True)
def one_thread():
    """Thousands of rounds over tensors of a few dozen numbers: one thread, no parallel region per op."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, float]:
    """(statistic, p-value) of counts against probs, over the outcomes probs allows.
    p-value = Q(df/2, stat/2), the chi-square survival function, without scipy."""
    support = probs > 0
    n = counts.sum()
    expected = n * probs[support]
    assert expected.min() >= 5, "too few expected counts in a cell for the chi-square approximation"
    stat = float(((counts[support] - expected) ** 2 / expected).sum())
    df = int(support.sum()) - 1
    return stat, float(torch.special.gammaincc(torch.tensor(df / 2.0), torch.tensor(stat / 2.0)))


def assert_2nd_and_3rd_tokens_follow_the_model(model, prompt: list[int], outputs, speculator) -> None:
    """Each output's 2nd and 3rd tokens (token ids, vocab 8) drawn as the model's own sampling at temperature 1
    draws them, by chi-square, with the speculator's acceptance far enough from 0 and 1 to test both paths."""
    counts = torch.zeros(2, 8)
    for tokens in outputs:
        counts[0, tokens[1]] += 1
        counts[1, tokens[2]] += 1
    with torch.no_grad():
        probs = lambda ids: model(torch.tensor([ids]))[0][-1].softmax(-1)  # noqa: E731
        first = probs(prompt)
        second = sum(first[a] * probs(prompt + [a]) for a in range(8))
        third = sum(first[a] * probs(prompt + [a])[b] * probs(prompt + [a, b]) for a in range(8) for b in range(8))
    acceptance = speculator.num_accepted / speculator.num_proposed
    # the n-gram test's acceptance is ~0.1 in expectation (0.106 and 0.094 under two noise streams): 5% of its
    # ~6,000 proposals is still hundreds of accepted tokens, and 95% hundreds rejected
    assert 0.05 < acceptance < 0.95, f"acceptance {acceptance:.3f} too one-sided to test both paths"
    for what, row, p in (("2nd token", counts[0], second), ("3rd token", counts[1], third)):
        stat, p_value = chi_square(row, p)
        assert p_value > 1e-6, f"{what}: chi-square {stat:.1f}, p-value {p_value:.2g}; {row.tolist()} vs {p.tolist()}"


def assert_distributed_as(counts, p, q, what):
    """counts ~ p at P_VALUE, nothing outside p's support, and the sample large enough to tell p from q."""
    assert counts[p == 0].sum() == 0, f"{what}: tokens the target's filters remove were produced: {counts.tolist()}"
    separation = float(counts.sum() * ((q - p)[p > 0] ** 2 / p[p > 0]).sum())  # the statistic expected under q
    stat, p_value = chi_square(counts, p)
    assert separation > 100, f"{what}: the proposer agrees with the target too often for the test to mean anything"
    assert p_value > P_VALUE, f"{what}: chi-square {stat:.1f}, p-value {p_value:.2g}; {counts.tolist()} vs p {p.tolist()}"


FILTER = LogitsFilter(temperature=0.8, top_k=5)  # V = 6: top-k removes one token from both p and q
TARGET_LOGITS = torch.tensor([[2.0, 1.5, 0.0, -0.5, -1.0, -3.0],
                              [0.0, 1.0, 2.0, 0.5, -1.0, 0.0],
                              [1.0, 0.0, 0.0, 0.0, 0.0, 3.0]])  # (k+1, V), k = 2  # fmt: skip
DRAFT_LOGITS = torch.tensor([[-1.0, 0.0, 2.5, 1.0, 0.0, -2.0],
                             [1.0, 1.0, 0.0, 0.0, 2.0, 0.0]])  # (k, V): favours what the target does not  # fmt: skip


def test_rejection_sampling_keeps_the_targets_distribution_with_a_disagreeing_draft():
    p, q = distribution(TARGET_LOGITS, FILTER), distribution(DRAFT_LOGITS, FILTER)  # (3, 6), (2, 6)
    generator, counts = torch.Generator().manual_seed(0), torch.zeros(6)
    for _ in range(10_000):
        proposed = [draw(q[0], generator), draw(q[1], generator)]  # as the draft model draws them
        counts[verify_sampled(TARGET_LOGITS, proposed, q, FILTER, generator)[0]] += 1
    assert_distributed_as(counts, p[0], q[0], "draft proposals")


def test_rejection_sampling_keeps_the_targets_distribution_with_certain_proposals():
    """Prompt lookup proposes with certainty (q is a point mass): keep d with probability p(d), else
    draw from p without d."""
    p = distribution(TARGET_LOGITS, FILTER)
    generator, counts = torch.Generator().manual_seed(1), torch.zeros(6)
    for _ in range(4_000):
        counts[verify_sampled(TARGET_LOGITS, [2, 4], None, FILTER, generator)[0]] += 1
    assert_distributed_as(counts, p[0], torch.nn.functional.one_hot(torch.tensor(2), 6).float(), "certain proposals")


def tiny_model(seed: int) -> Qwen3:
    """A random Qwen3 with an 8-token vocabulary, in memory (torch's default init). Untied: with a tied
    embedding, the logits of a random model favour its input token, and any two such models agree."""
    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=16, max_position_embeddings=64, torch_dtype="float32",
                         tie_word_embeddings=False)  # fmt: skip
    model = Qwen3(config).eval()
    model.build_rope_tables()
    return model


def test_a_speculative_round_over_real_models_draws_the_first_token_from_the_target():
    """The whole round: a draft model proposes k = 2 tokens from its own filtered distribution, the
    target checks them in one forward over its cache, and the cache is rolled back for the next trial."""
    target, draft = tiny_model(0), tiny_model(1)
    params = LogitsFilter(temperature=0.5, top_k=4)  # p and q overlap by ~45%: both branches run often
    prefix, last = [1, 2, 3, 4], 5
    p = distribution(ConversationCache(target).prefill(prefix + [last]), params)[0]  # (V,) the target alone
    q = distribution(ConversationCache(draft).prefill(prefix + [last]), params)[0]
    cache, proposer = ConversationCache(target), DraftModel(draft, target)
    cache.prefill(prefix)
    generator, counts = torch.Generator().manual_seed(2), torch.zeros(8)
    for _ in range(1_500):
        new, proposed = speculate(cache, proposer, last, 2, params, generator)
        counts[new[0]] += 1
        cache.truncate(len(prefix))  # back to the state before the round
    assert proposed == 2
    assert_distributed_as(counts, p, q, "a draft model's round")
