"""Speculative decoding in the engine: every decoding sequence's proposals checked in the step's one forward.

The simple loops speculate one sequence at a time (generation/speculative.py); here a step's decodes
speculate together, each row its own way, with the same parts: prompt lookup proposes
(sampling/prompt_lookup.py), the target's logits decide (sampling/rejection.py). One step:

  1. `propose`: each decoding sequence looks its last few tokens up in its own tokens; a match becomes
     up to k proposals, carried on its chunk. The row then runs its newest token and the proposals at
     positions p..p+k (batch.py lays rows of any length end to end, so ragged k costs no padding), in
     blocks grown for them now;
  2. the step's one forward gives that row k+1 rows of logits: after its newest token, after each proposal;
  3. `accept`: keep the longest run the target agrees with (greedy), or keep each proposal with
     probability p(x), resampling from p without x at the first rejection (temperature > 0: rejection
     sampling against a point mass, exactly as the loops do); emit the kept tokens and the target's
     next one through the engine's own `append`, one by one, so EOS, stop strings and max_tokens cut
     the run where they fall;
  4. roll back: the sequence's computed length stops after its kept tokens, and blocks that hold only
     rejected slots go back to the pool. Their slots are never sealed: a block is hashed for the prefix
     cache only once `num_computed` covers it (block_manager.seal_full_blocks), and `num_computed` only
     ever counts kept tokens, so a speculative token never makes a block look final.

Backing off (`Backoff`): a sequence whose proposals keep being rejected stops proposing for a while,
longer each time, so a workload where nothing matches costs the lookups and little else.

Sequences with a grammar, logit processing or logprobs decode plainly: their rows need the sampler's
per-token processing, which rejection sampling would have to redo for every proposal.
"""

import json
from dataclasses import dataclass, fields

import torch

from qwen3_scratch.errors import GenerationError
from qwen3_scratch.sampling.prompt_lookup import PromptLookup
from qwen3_scratch.sampling.rejection import verify_greedy, verify_sampled

from .scheduler import Chunk, ScheduledBatch, Sequence, Status

MAX_SPECULATIVE_TOKENS = 15


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `speculative_config` for prompt lookup: {"method": "ngram", "num_speculative_tokens": k, ...}."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 3  # the longest suffix looked up
    prompt_lookup_min: int = 1  # the shortest suffix that may match

    @classmethod
    def parse(cls, value) -> "SpeculativeConfig | None":
        """From a dict or a JSON string (None: no speculation); a bad value raises a one-line error naming the field."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as error:
                raise GenerationError(f"speculative_config is not valid JSON ({error.msg}): "
                                      """write e.g. '{"method": "ngram", "num_speculative_tokens": 4}'""") from None
        if not isinstance(value, dict):
            raise GenerationError("speculative_config must be a JSON object, e.g. {\"method\": \"ngram\"}")
        known = {f.name for f in fields(cls)}
        for name in value:
            if name not in known:
                raise GenerationError(f"speculative_config.{name} is not a known field; "
                                      f"use {', '.join(sorted(known))}")  # fmt: skip
        if value.get("method", "ngram") != "ngram":
            raise GenerationError(f"speculative_config.method must be \"ngram\" (prompt lookup), got {value['method']!r}")
        config = cls(**value)
        limits = {"num_speculative_tokens": MAX_SPECULATIVE_TOKENS, "prompt_lookup_max": 64, "prompt_lookup_min": 64}
        for name, most in limits.items():
            got = getattr(config, name)
            if not isinstance(got, int) or isinstance(got, bool) or not 1 <= got <= most:
                raise GenerationError(f"speculative_config.{name} must be an integer from 1 to {most}, got {got!r}")
        if config.prompt_lookup_min > config.prompt_lookup_max:
            raise GenerationError("speculative_config.prompt_lookup_min must be <= prompt_lookup_max, got "
                                  f"{config.prompt_lookup_min} > {config.prompt_lookup_max}")  # fmt: skip
        return config


class Backoff:
    """When a sequence proposes: a round that keeps nothing pauses it for `gap` steps, the gap doubling (from
    PAUSE up to MAX_GAP) while such rounds follow each other; a round that keeps anything brings it back to
    PAUSE. A sequence whose proposals are never right then spends a round every few dozen, then hundred, steps."""

    PAUSE, MAX_GAP = 16, 256

    def __init__(self):
        self.paused, self.gap = 0, self.PAUSE

    def ready(self) -> bool:
        if self.paused:
            self.paused -= 1
            return False
        return True

    def update(self, proposed: int, kept: int) -> None:
        if kept:
            self.gap = self.PAUSE
        else:
            self.paused, self.gap = self.gap, min(2 * self.gap, self.MAX_GAP)


class SequenceSpeculation:
    """What one sequence carries between steps: its n-gram index and its back-off."""

    def __init__(self, config: SpeculativeConfig):
        self.lookup = PromptLookup(config.prompt_lookup_max, config.prompt_lookup_min)
        self.backoff = Backoff()


class Speculator:
    """Prompt lookup for an engine's decodes (see the module docstring); counts what it did (metrics)."""

    def __init__(self, config: SpeculativeConfig, engine):
        self.config, self.engine = config, engine
        self.num_proposed = 0  # tokens proposed and checked by the target
        self.num_accepted = 0  # of those, kept
        self.num_emitted = 0  # tokens speculative rows emitted: the kept ones and the target's own

    @staticmethod
    def eligible(seq: Sequence) -> bool:
        plain = seq.sampling is None or not seq.sampling.active
        return plain and seq.params.logprobs is None and seq.num_uncomputed == 1

    def propose(self, batch: ScheduledBatch) -> None:
        """Attach proposals to the batch's decodes that find some, and blocks for them."""
        engine = self.engine
        for chunk in batch.decodes:
            seq = chunk.seq
            if not self.eligible(seq):
                continue
            if seq.speculation is None:
                seq.speculation = SequenceSpeculation(self.config)
            # the run emits k + 1 tokens at most: never past max_tokens or the context
            room = min(seq.max_tokens - len(seq.output_ids), engine.context - len(seq.token_ids)) - 1
            k = min(self.config.num_speculative_tokens, room)
            if k < 1 or not seq.speculation.backoff.ready():
                continue
            proposed, _ = seq.speculation.lookup.propose(seq.token_ids, k)
            if proposed and engine.blocks.ensure_capacity(seq.block_table, len(seq.token_ids) + len(proposed)):
                chunk.proposed = proposed
        # one-token rows first: packed attention batches the leading one-token rows (batch.py)
        batch.decodes.sort(key=lambda chunk: bool(chunk.proposed))

    def accept(self, chunk: Chunk, logits: torch.Tensor) -> list:
        """The tokens chunk's row produces from its logits (1+k, V), appended through the engine one by one
        (stop conditions in order); then the sequence is rolled back past them. Returns the engine's StepOutputs."""
        seq, proposed, engine = chunk.seq, chunk.proposed, self.engine
        if seq.params.logits_filter.greedy:
            new = verify_greedy(logits, proposed)
        else:  # prompt lookup proposes with certainty: a point mass, q = None
            new = verify_sampled(logits, proposed, None, seq.params.logits_filter, seq.generator)
        kept = len(new) - 1
        seq.speculation.backoff.update(len(proposed), kept)
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
        they fill, and give back the blocks past its newest token, which held only rejected proposals."""
        blocks = self.engine.blocks
        seq.num_computed = len(seq.token_ids) - 1
        blocks.seal_full_blocks(seq.block_table, seq.token_ids, seq.num_computed)
        keep = blocks.blocks_for(len(seq.token_ids))
        surplus = seq.block_table[keep:]
        del seq.block_table[keep:]
        blocks.free_table(surplus)
