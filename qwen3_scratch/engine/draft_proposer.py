"""A draft model as the engine's proposer: a smaller Qwen3 with the target's tokenizer guesses k tokens
for every speculating row, in k batched forwards (one per draft position, not one per row).

The draft keeps its keys/values in a pool of its own with the target's block count and size, read
through the *same* block tables. So block b of a sequence holds the target's keys of its tokens in the
target's pool and the draft's keys of the same tokens in the draft's pool, and everything the block
manager does (sharing a cached prefix, giving blocks back, preempting) holds for both at once. That
needs one rule: the draft runs every token the target runs. Each step's first draft forward therefore
runs all of the step's chunks (prompt chunks, and every decode's newest token, speculating or not),
and its last-token logits give each speculating row its first proposal. Forwards 2..k run only the rows
still drafting, one token each (ragged k: a row drops out once it has its k).

The draft never runs its own last proposal d_k. When the target keeps all k, d_k is computed in the
target's pool but not yet in the draft's: the sequence's `lag` is 1, the next step's first forward runs
[d_k, newest] for that row, and until then the block holding d_k is not sealed for the prefix cache
(speculative.roll_back seals through num_computed - lag).

Greedy rows propose the draft's argmax; sampling rows draw from the draft's distribution after the
request's filters (temperature, top-k, top-p, min-p) with the request's generator, and keep those
(k, V) distributions for the rejection sampling (sampling/rejection.py), as the loops' draft does.

Shapes: R rows in a forward, k proposals per row, V vocab.
"""

from dataclasses import dataclass

import torch

from qwen3_scratch.checkpoint.hub import resolve_checkpoint
from qwen3_scratch.checkpoint.weights import load_model
from qwen3_scratch.errors import CheckpointError, Qwen3Error, printable
from qwen3_scratch.model.config import Qwen3Config
from qwen3_scratch.model.qwen3 import Qwen3
from qwen3_scratch.sampling.rejection import distribution, draw
from qwen3_scratch.text.tokenizer import Tokenizer

from .batch import pack
from .model_runner import ModelRunner
from .paged_cache import PagedKVCache
from .scheduler import Chunk, ScheduledBatch, Sequence
from .speculative_config import SpeculativeConfig


@dataclass
class DraftRow:
    """One row of a draft forward, in the shape batch.pack reads a Chunk: tokens `ids` at positions start..."""

    seq: Sequence
    start: int
    ids: list[int]
    proposed = ()  # a draft row checks nothing

    @property
    def end(self) -> int:
        return self.start + len(self.ids)

    @property
    def new_ids(self) -> list[int]:
        return self.ids


class DraftProposer:
    def __init__(self, config: SpeculativeConfig, engine, draft: Qwen3 | None = None):
        """draft: the loaded draft model (None: load config.model in the target's device and dtype)."""
        target = engine.model
        if draft is None:
            draft = load_draft(config.model, target, engine.tokenizer)
        check_draft_model(draft, target)
        self.model, self.blocks = draft, engine.blocks
        self.cache = PagedKVCache(draft.config, engine.blocks.num_blocks, engine.blocks.block_size, draft.device,
                                  draft.activation_dtype)  # fmt: skip
        self.runner = ModelRunner(draft, self.cache)

    def propose(self, batch: ScheduledBatch, rows: list[tuple[Chunk, int]]) -> None:
        """Run the draft over the step's chunks, then give each row of `rows` (chunk, k) k proposals."""
        budget = {id(chunk.seq): k for chunk, k in rows if self._grow(chunk.seq, k)}
        first = self._first_rows(batch)
        self.model.reserve_positions(max(row.end for row in first) + max(budget.values(), default=0))
        logits = self._run(first)  # (R, V)
        where = {id(row.seq): i for i, row in enumerate(first)}  # a sequence runs one chunk a step
        drafting = [(chunk, logits[where[id(chunk.seq)]]) for chunk, _ in rows if id(chunk.seq) in budget]
        probs = {id(chunk.seq): [] for chunk, _ in drafting}
        while drafting:
            for chunk, row in drafting:
                chunk.proposed.append(self._draw(chunk.seq, row, probs[id(chunk.seq)]))
            drafting = [(chunk, row) for chunk, row in drafting if len(chunk.proposed) < budget[id(chunk.seq)]]
            if drafting:  # each runs its newest proposal, at the position after its tokens and earlier ones
                logits = self._run([DraftRow(c.seq, len(c.seq.token_ids) + len(c.proposed) - 1, c.proposed[-1:])
                                    for c, _ in drafting])  # fmt: skip
                drafting = [(chunk, logits[i]) for i, (chunk, _) in enumerate(drafting)]
        for chunk, _ in rows:
            if probs.get(id(chunk.seq)):
                chunk.seq.speculation.probs = torch.stack(probs[id(chunk.seq)])  # (k, V)

    def _grow(self, seq: Sequence, k: int) -> bool:
        """Blocks for seq's newest token and k proposals (the target checks them all); False if the pool is short."""
        return self.blocks.ensure_capacity(seq.block_table, len(seq.token_ids) + k)

    @staticmethod
    def _first_rows(batch: ScheduledBatch) -> list[DraftRow]:
        """Every token the target runs this step, and what the draft lags behind, one-token rows first."""
        rows, decodes = [], {id(chunk) for chunk in batch.decodes}
        for chunk in batch.decodes + batch.prefills:
            seq, state = chunk.seq, chunk.seq.speculation
            # a prompt chunk (a recompute after preemption too) starts where the draft's keys are complete
            lag = state.lag if state is not None and id(chunk) in decodes else 0
            if state is not None:
                state.lag = 0
            rows.append(DraftRow(seq, chunk.start - lag, seq.token_ids[chunk.start - lag : chunk.end]))
        return sorted(rows, key=lambda row: len(row.ids) > 1)

    def _run(self, rows: list[DraftRow]) -> torch.Tensor:
        """One draft forward over rows -> the logits after each row's last token, (R, V)."""
        return self.runner.forward(pack(rows, self.cache.block_size, self.cache.scratch_block, self.runner.device))

    @staticmethod
    def _draw(seq: Sequence, logits: torch.Tensor, probs: list) -> int:
        """The draft's next token from its logits (V,): argmax, or a draw after the request's filters."""
        params = seq.params.logits_filter
        if params.greedy:
            return int(logits.argmax())
        q = distribution(logits[None], params)[0]  # (V,)
        probs.append(q)
        return draw(q, seq.generator)

    @staticmethod
    def lag_after(proposed: int, kept: int) -> int:
        return 1 if kept == proposed else 0  # the draft never ran d_k: see the module docstring


def check_draft_model(draft: Qwen3, target: Qwen3) -> None:
    """A draft must score the target's token ids and follow every position the target can reach."""
    if draft.config.vocab_size != target.config.vocab_size:
        raise CheckpointError(f"speculative_config.model: the draft has vocab_size={draft.config.vocab_size} but "
                              f"the target has {target.config.vocab_size}; a draft model must share the target's "
                              "vocabulary")  # fmt: skip
    if draft.config.max_position_embeddings < target.config.max_position_embeddings:
        raise CheckpointError(f"speculative_config.model: the draft's context ({draft.config.max_position_embeddings}) "
                              f"is shorter than the target's ({target.config.max_position_embeddings}); pick a draft "
                              "with at least the target's max_position_embeddings")  # fmt: skip


def load_draft(model: str, target: Qwen3, tokenizer: Tokenizer | None, *, weights_dir="weights",
               local_files_only: bool = False) -> Qwen3:  # fmt: skip
    """The draft checkpoint `model` (a folder or Hub id), loaded for batches in the target's device and dtype,
    after checking that its tokenizer and its logits' width are the target's (before its weights load)."""
    try:
        folder = resolve_checkpoint(model, weights_dir, local_files_only=local_files_only)
        draft_tokenizer = Tokenizer.from_checkpoint(folder)
        vocab_size = Qwen3Config.from_json(folder / "config.json").vocab_size
    except Qwen3Error as error:
        raise cannot_load(model, error) from None
    if tokenizer is not None:
        ours, theirs = (t.vocab() for t in (tokenizer, draft_tokenizer))
        if ours != theirs:
            raise CheckpointError(f"speculative_config.model: {printable(folder / 'tokenizer.json')} ({len(theirs)} "
                                  f"tokens) is not the target's vocabulary ({len(ours)} tokens); a draft model must "
                                  "use the target's tokenizer")  # fmt: skip
    if vocab_size != target.config.vocab_size:
        raise CheckpointError(f"speculative_config.model: {printable(folder / 'config.json')} says "
                              f"vocab_size={vocab_size} but the target has {target.config.vocab_size}; a draft model "
                              "must share the target's vocabulary")  # fmt: skip
    try:
        return load_model(folder, device=target.device, dtype=target.activation_dtype, optimize="batch")
    except Qwen3Error as error:
        raise cannot_load(model, error) from None


def cannot_load(model: str, error: Qwen3Error) -> CheckpointError:
    return CheckpointError(f"speculative_config.model: the draft {printable(model)!r} cannot load: {error}")
