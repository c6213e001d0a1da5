"""Speculative decoding in the engine: every decoding sequence's proposals checked in the step's one forward.

The simple loops speculate one sequence at a time (generation/speculative.py); here a step's decodes
speculate together, each row its own way, with the same parts: a proposer guesses (prompt lookup,
sampling/prompt_lookup.py, below; or a draft model, draft_proposer.py), the target's logits decide
(sampling/rejection.py). One step:

  1. `propose`: each decoding sequence that may speculate gets a budget of k tokens, and the proposer
     attaches up to k proposals to its chunk. The row then runs its newest token and the proposals at
     positions p..p+k (batch.py lays rows of any length end to end, so ragged k costs no padding), in
     blocks grown for them now;
  2. the step's one forward gives that row k+1 rows of logits: after its newest token, after each proposal;
  3. `accept`: keep the longest run the target agrees with (greedy), or keep each proposal by rejection
     sampling (temperature > 0: against the draft's distribution, or a point mass for prompt lookup,
     exactly as the loops do); emit the kept tokens and the target's next one through the engine's own
     `append`, one by one, so EOS, stop strings and max_tokens cut the run where they fall;
  4. roll back: the sequence's computed length stops after its kept tokens, and blocks that hold only
     rejected slots go back to the pool. Their slots are never sealed: a block is hashed for the prefix
     cache only once `num_computed` covers it (block_manager.seal_full_blocks), and `num_computed` only
     ever counts kept tokens, so a speculative token never makes a block look final. With a draft
     model, a block is sealed only once the draft's keys are in it too (`SequenceSpeculation.lag`).

Backing off (`Backoff`): a sequence whose proposals keep being rejected stops proposing for a while,
longer each time, so a workload where nothing matches costs the lookups and little else.

Sequences with a grammar, logit processing or logprobs decode plainly: their rows need the sampler's
per-token processing, which rejection sampling would have to redo for every proposal.
"""

import torch

from qwen3_scratch.sampling.prompt_lookup import PromptLookup
from qwen3_scratch.sampling.rejection import verify_greedy, verify_sampled

from .scheduler import Chunk, ScheduledBatch, Sequence, Status
from .speculative_config import MAX_SPECULATIVE_TOKENS, SpeculativeConfig  # noqa: F401 (the engine's names)


class Backoff:
    """When a sequence proposes: a round that keeps nothing pauses it for `gap` steps, the gap doubling (from
    PAUSE up to MAX_GAP) while such rounds follow each other; a round that keeps anything brings it back to
    PAUSE. A sequence whose proposals are never right then spends a round every few dozen, then hundred, steps.

    A sequence whose last round kept nothing proposes only on steps that are multiples of ALIGN (a new one
    proposes at once: its text may quote from the start): such rounds, mostly wasted where nothing is accepted, then share steps. What a wasted
    round costs is mostly its step's: a step with one speculative row leaves the one-token decode path (its
    tokens and logits rows padded to buckets, its logits checked apart; ~1.2x a plain step of the tiny model),
    and 16 sequences probing at 16 different steps made 37 of 128 steps such steps on the no-accept
    benchmark (docs/performance.md)."""

    PAUSE, MAX_GAP, ALIGN = 16, 256, 8

    def __init__(self):
        self.paused, self.gap, self.kept_last = 0, self.PAUSE, True

    def ready(self, step: int) -> bool:
        if self.paused:
            self.paused -= 1
            return False
        return self.kept_last or step % self.ALIGN == 0

    def update(self, proposed: int, kept: int) -> None:
        self.kept_last = kept > 0
        if kept:
            self.gap = self.PAUSE
        else:
            self.paused, self.gap = self.gap, min(2 * self.gap, self.MAX_GAP)


class SequenceSpeculation:
    """What one sequence carries between steps."""

    def __init__(self, config: SpeculativeConfig):
        self.backoff = Backoff()
        ngram = config.method == "ngram"
        self.lookup = PromptLookup(config.prompt_lookup_max, config.prompt_lookup_min) if ngram else None
        self.probs: torch.Tensor | None = None  # (k, V) this round's draft distributions (sampling), else None
        self.lag = 0  # trailing computed tokens the draft model has not run yet (1 after a round kept all)


class PromptLookupProposer:
    """Each row's proposals from its own tokens (sampling/prompt_lookup.py); blocks grown for those it finds."""

    def __init__(self, engine):
        self.blocks = engine.blocks

    def propose(self, batch: ScheduledBatch, rows: list[tuple[Chunk, int]]) -> None:
        for chunk, k in rows:
            seq = chunk.seq
            proposed, _ = seq.speculation.lookup.propose(seq.token_ids, k)
            if proposed and self.blocks.ensure_capacity(seq.block_table, len(seq.token_ids) + len(proposed)):
                chunk.proposed = proposed

    @staticmethod
    def lag_after(proposed: int, kept: int) -> int:
        return 0  # no model of its own: nothing to catch up


class Speculator:
    """Speculation for an engine's decodes (see the module docstring); counts what it did (metrics)."""

    def __init__(self, config: SpeculativeConfig, engine, draft=None):
        """draft: the loaded draft model for method "draft_model" (None: loaded from config.model)."""
        self.config, self.engine = config, engine
        if config.method == "draft_model":
            from .draft_proposer import DraftProposer

            self.proposer = DraftProposer(config, engine, draft)
        else:
            self.proposer = PromptLookupProposer(engine)
        self.num_proposed = 0  # tokens proposed and checked by the target
        self.num_accepted = 0  # of those, kept
        self.num_emitted = 0  # tokens speculative rows emitted: the kept ones and the target's own
        self.num_steps = 0  # steps proposed for (Backoff.ALIGN's clock)

    @property
    def method(self) -> str:
        return self.config.method

    @staticmethod
    def eligible(seq: Sequence) -> bool:
        plain = seq.sampling is None or not seq.sampling.active
        return plain and seq.params.logprobs is None and seq.num_uncomputed == 1

    def budget(self, seq: Sequence) -> int:
        """How many tokens seq may propose this step (0: it decodes plainly)."""
        if not self.eligible(seq):
            return 0
        if seq.speculation is None:
            seq.speculation = SequenceSpeculation(self.config)
        seq.speculation.probs = None
        # the run emits k + 1 tokens at most: never past max_tokens or the context
        room = min(seq.max_tokens - seq.num_output_tokens, self.engine.context - len(seq.token_ids)) - 1
        k = min(self.config.num_speculative_tokens, room)
        return k if k >= 1 and seq.speculation.backoff.ready(self.num_steps) else 0

    def propose(self, batch: ScheduledBatch) -> None:
        """Attach proposals to the batch's decodes that get some, and blocks for them."""
        self.num_steps += 1
        rows = [(chunk, k) for chunk in batch.decodes for k in [self.budget(chunk.seq)] if k]
        self.proposer.propose(batch, rows)
        # one-token rows first: packed attention batches the leading one-token rows (batch.py)
        batch.decodes.sort(key=lambda chunk: bool(chunk.proposed))

    def accept(self, chunk: Chunk, logits: torch.Tensor) -> list:
        """The tokens chunk's row produces from its logits (1+k, V), appended through the engine one by one
        (stop conditions in order); then the sequence is rolled back past them. Returns the engine's StepOutputs."""
        seq, proposed, engine = chunk.seq, chunk.proposed, self.engine
        state = seq.speculation
        if seq.params.logits_filter.greedy:
            new = verify_greedy(logits, proposed)
        else:  # q: the draft's distributions; None for prompt lookup, which proposes with certainty
            new = verify_sampled(logits, proposed, state.probs, seq.params.logits_filter, seq.generator)
        kept = len(new) - 1
        state.backoff.update(len(proposed), kept)
        state.lag = self.proposer.lag_after(len(proposed), kept)
        self.num_proposed += len(proposed)
        self.num_accepted += kept
        outputs = []
        for token in new:
            outputs.append(engine.append(seq, token))
            if outputs[-1].finished:
                break
        self.num_emitted += len(outputs)
        if seq.status is Status.RUNNING:
            self.roll_back(seq)
        return outputs

    def roll_back(self, seq: Sequence) -> None:
        """seq's keys/values are final through its kept tokens (its newest is still to run): seal the blocks
        they fill (those the draft, if any, has filled too), and give back the blocks past its newest token,
        which held only rejected proposals."""
        blocks = self.engine.blocks
        seq.num_computed = len(seq.token_ids) - 1
        blocks.seal_full_blocks(seq.block_table, seq.token_ids, seq.num_computed - seq.speculation.lag)
        keep = blocks.blocks_for(len(seq.token_ids))
        surplus = seq.block_table[keep:]
        del seq.block_table[keep:]
        blocks.free_table(surplus)
