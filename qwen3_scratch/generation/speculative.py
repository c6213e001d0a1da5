"""Speculative decoding: several tokens per read of the weights, and the same output as plain decoding.

Batch-1 decode reads every weight once per token, so it runs at bandwidth / model size tokens per second
whatever the kernels do. Reading the weights once for several tokens is the way past that: something
cheap proposes k tokens, and the target model checks all of them in one forward over k+1 positions,
which on a CPU costs about what a one-token step costs (kernels/fewrow.py) and on a GPU even less.
One round, `speculate` below:

    1. propose up to k tokens after the sequence: prompt lookup (sampling/prompt_lookup.py) or a draft model
       (draft_model.py);
    2. run the target once over [newest token, proposals]: k+1 rows of logits (its KV cache gets
       those k+1 slots; rows tell what the target would say after each prefix);
    3. keep the proposals the target agrees with, then take one token from the target itself
       (sampling/rejection.py: greedy agreement, or rejection sampling, so the output is exactly the
       target's: the same tokens when greedy, the same distribution when sampling);
    4. roll the caches back past the kept tokens: the target's slots of rejected proposals are
       forgotten (stale slots, which the causal mask never shows and the next forward overwrites),
       and so are the draft's.

Each round makes 1 to k+1 tokens for one target forward. `AdaptiveK` picks each round's k from the
acceptance seen so far, down to 0 (a plain decode step) when proposals are not being kept, so a
proposer that never guesses right costs next to nothing. The target's cache is a ConversationCache
(conversation.py): one sequence, batch 1, which is where speculation pays (vLLM, too, turns it off
as batches grow).

Shapes: k proposed tokens, V vocab.
"""

from collections.abc import Iterator

import torch

from qwen3_scratch.errors import GenerationError
from qwen3_scratch.kernels.fewrow import use_fewrow
from qwen3_scratch.sampling.logits import NON_FINITE, LogitsFilter, sample
from qwen3_scratch.sampling.rejection import verify

from .conversation import ConversationCache
from .draft_model import DraftModel
from qwen3_scratch.sampling.prompt_lookup import PromptLookup
from .stats import SpeculationStats

METHODS = ("ngram", "draft")
MAX_SPECULATIVE_TOKENS = 15  # a verification forward of at most 16 rows (kernels/fewrow.MAX_ROWS)
# What a round may propose at most, chosen by measurement (docs/performance.md, "Speculative decoding").
DEFAULT_SPECULATIVE_TOKENS = {"ngram": 4, "draft": 4}


def speculate(target: ConversationCache, proposer, last: int, k: int, params: LogitsFilter,
              generator: torch.Generator | None = None) -> tuple[list[int], int]:  # fmt: skip
    """One round after `last`, the newest token (chosen, not yet run: the target's cache holds the
    sequence before it). Returns the tokens the round produces (the kept proposals, then the target's
    own next token) and how many tokens were proposed."""
    start = len(target.tokens)
    proposed, proposal_probs = proposer.propose(target.tokens + [last], k, params, generator)  # (k,), (k, V) or None
    if not proposed:  # nothing to check: a plain decode step (chat's loop), no verification machinery
        return [int(sample(target.step(last), params, generator))], 0
    logits = target.extend([last] + proposed)  # (k+1, V): one forward, row i says what follows proposal i
    new = verify(logits, proposed, proposal_probs, params, generator)  # 1 to k+1 tokens
    # Keep `last` and the kept proposals; the slots after them held rejected tokens.
    target.truncate(start + len(new))
    proposer.rollback(start + len(new))
    return new, len(proposed)


def forward_cost(k: int, products: str) -> float:
    """A target forward over k+1 rows, in one-row decode steps, by what multiplies its few rows:

    "fewrow"    bf16 on a CPU, the matrices packed for oneDNN (kernels/fewrow.py). Measured at the 0.6B
                shapes on the 2-core Zen 4, the layer as four products (FewRowDecoderLayer;
                docs/performance.md, "A verification as four products a layer"): 2..6 rows cost 1.28-1.45
                steps, 7..9 rows 1.47-1.71 (four runs); the fit: 1.40 while oneDNN's few-row kernel takes
                about as long for any of them, then 1.0 + 0.09 k.
    "F.linear"  bf16 on a CPU without the packed copies: oneDNN reorders each matrix at every call;
                measured at 1.8-2.4 (2 rows) to 2.0-2.8 (5 rows) steps next to the compiled one-row
                loop; speculation rarely pays there.
    "other"     fp32 or fp16 on a CPU, and GPUs: not measured. A guess, 1 + 0.1 k: a few rows cost
                about one read of the weights (on a GPU, a one-row step leaves the multipliers idle).
    """
    if k == 0:
        return 1.0
    if products == "fewrow":
        return max(1.40, 1.0 + 0.09 * k)
    if products == "F.linear":
        return 1.7 + 0.08 * k
    return 1.0 + 0.1 * k


def products_of(model) -> str:
    """Which of forward_cost's measurements applies to `model`."""
    if getattr(model, "fewrow", False):
        return "fewrow"
    bf16_cpu = model.device.type == "cpu" and model.model.embed_tokens.weight.dtype == torch.bfloat16
    return "F.linear" if bf16_cpu else "other"


class AdaptiveK:
    """Each round's k, from the acceptance seen so far.

    If each proposed token is kept with probability a, a round proposing k tokens makes
    (1 - a^(k+1)) / (1 - a) tokens on average. It costs, in one-row decode steps, the target's
    forward over k+1 rows (`forward_cost`) plus k proposals (a draft step: its bytes next to the
    target's; prompt lookup: nothing). The k in 0..max_k with the most tokens per cost wins. a is
    counted over the last few rounds, so k follows the text: high while the answer quotes its input,
    0 (plain decoding) where it does not, and then a round after `probe_gap` plain steps proposes
    tokens again to see whether acceptance came back: as many as pay best at a = 1/2 (`probe_k`: on a
    bf16 CPU 2 to 5 rows cost the same, so a probe of 4 tokens costs no more than one of 1). Each probe
    that keeps nothing doubles the gap (PROBE_EVERY up to MAX_PROBE_GAP), so a proposer that never
    guesses right costs a probe every few hundred tokens; one kept token brings the gap back. The
    first gap is short because quoting comes in bursts: an answer that stops quoting for a line often
    quotes again after it. Only counts decide k, never timings, so a seeded generation is repeatable.
    Tried and not kept (docs/performance.md, "A verification as four products a layer"): a draft step
    weighed at its measured time (0.11 target steps, against 0.08 by bytes), and a 10% margin demanded
    over plain steps. Either made a draft kept half the time level with plain rather than 5% behind,
    and gave up the 15% a draft kept 65% of the time gains: the estimate of a wanders near the cut.
    """

    DECAY = 0.8  # the weight of a round's counts after each further round
    PROBE_EVERY = 4
    MAX_PROBE_GAP = 256

    def __init__(self, max_k: int, proposal_cost: float, products: str = "fewrow", adaptive: bool = True):
        self.max_k, self.proposal_cost, self.products, self.adaptive = max_k, proposal_cost, products, adaptive
        self.kept, self.checked = 1.0, 2.0  # a prior of one round with a = 1/2
        self.plain_steps, self.probe_gap, self.probing = 0, self.PROBE_EVERY, False

    def choose(self) -> int:
        if not self.adaptive:
            return self.max_k
        k = max(range(self.max_k + 1), key=self.tokens_per_step)
        self.probing = False
        if k == 0:
            self.plain_steps += 1
            if self.plain_steps > self.probe_gap:
                self.plain_steps, self.probing = 0, True
                return self.probe_k
        return k

    @property
    def probe_k(self) -> int:
        return max(range(1, self.max_k + 1), key=lambda k: self.tokens_per_step(k, a=0.5))

    def tokens_per_step(self, k: int, a: float | None = None) -> float:
        """Expected tokens per decode step's worth of time, with k proposals a round (a: the acceptance
        seen so far, unless given)."""
        a = min(self.kept / self.checked, 0.999) if a is None else a
        return (1 - a ** (k + 1)) / (1 - a) / (forward_cost(k, self.products) + k * self.proposal_cost)

    def update(self, proposed: int, kept: int) -> None:
        """A round's outcome: `kept` of `proposed` tokens. The trials are the kept ones and the first
        rejected one (the target never judged the ones after it)."""
        if proposed:
            self.kept = self.DECAY * self.kept + kept
            self.checked = self.DECAY * self.checked + kept + (kept < proposed)
        if kept:
            self.probe_gap = self.PROBE_EVERY
        elif self.probing:
            self.probe_gap = min(2 * self.probe_gap, self.MAX_PROBE_GAP)


class Speculator:
    """How a pipeline speculates: a proposer (PromptLookup or DraftModel) and at most k tokens a round."""

    def __init__(self, proposer, num_speculative_tokens: int, adaptive: bool = True):
        self.proposer, self.max_k, self.adaptive = proposer, num_speculative_tokens, adaptive
        self.stats = SpeculationStats()  # of the last generation

    def generate(self, target: ConversationCache, prompt: list[int], n_new: int, params: LogitsFilter,
                 generator: torch.Generator | None = None, stop_ids=()) -> Iterator[int]:  # fmt: skip
        """Yield the tokens after `prompt` one at a time, as plain decoding over `target` would: the
        same tokens (greedy) or the same distribution (sampling). Ends after a stop id, after n_new
        tokens, or at NON_FINITE (the caller must stop there), wherever it falls inside a round."""
        policy = AdaptiveK(self.max_k, self.proposer.cost, products_of(target.model), self.adaptive)
        self.stats = SpeculationStats()
        self.proposer.start(prompt)
        new = [int(sample(target.prefill(prompt, reserve=n_new), params, generator))]
        produced = 0
        while True:
            for token in new:
                yield token
                produced += 1
                if token in stop_ids or token == NON_FINITE or produced == n_new:
                    return
            # this round makes at most k + 1 tokens: never past n_new, which the context already bounds
            k = min(policy.choose(), n_new - produced - 1)
            new, proposed = speculate(target, self.proposer, new[-1], k, params, generator)
            policy.update(proposed, len(new) - 1)
            self.stats.add_round(proposed, len(new) - 1)


def make_speculator(method: str | None, target, draft=None, num_speculative_tokens: int | None = None):
    """The Speculator for Pipeline's settings (check_speculative's), or None for plain decoding."""
    if method is None:
        return None
    use_fewrow(target)  # a bf16 CPU target's verification products share one read of each matrix
    proposer = PromptLookup() if method == "ngram" else DraftModel(draft, target)
    return Speculator(proposer, num_speculative_tokens or DEFAULT_SPECULATIVE_TOKENS[method])


def check_speculative(method, draft_model, num_speculative_tokens, use_cache=True, compile=False) -> None:
    """The speculation settings, checked before anything loads; messages name the CLI flags."""
    if method is not None and not use_cache:
        raise GenerationError("--speculative needs the KV cache (it rolls the cache back); drop --no-kv-cache")
    if method is not None and compile:
        raise GenerationError("--speculative does not run as CUDA graphs (its forwards change length); drop --compile")
    if method is None:
        if draft_model is not None or num_speculative_tokens is not None:
            flag = "--draft-model" if draft_model is not None else "--num-speculative-tokens"
            raise GenerationError(f"{flag} needs --speculative (ngram or draft)")
        return
    if method not in METHODS:
        raise GenerationError(f"--speculative must be one of {', '.join(METHODS)}, got {method!r}")
    if method == "draft" and draft_model is None:
        raise GenerationError("--speculative draft needs --draft-model (a smaller Qwen3 with the same tokenizer)")
    if method == "ngram" and draft_model is not None:
        raise GenerationError("--draft-model is for --speculative draft; prompt lookup (ngram) uses no model")
    k = num_speculative_tokens
    if k is not None and (not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS):
        raise GenerationError(f"--num-speculative-tokens must be an integer from 1 to {MAX_SPECULATIVE_TOKENS}, "
                              f"got {k!r}")  # fmt: skip
