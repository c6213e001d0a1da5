"""Which tokens run in the next step: requests in, one batch out, iteration by iteration.

A `Sequence` is one request inside the engine: its token ids (prompt, then output), how many of
them already have keys/values in the cache, its block table and its stopping rules. The
`Scheduler` keeps two queues, `waiting` and `running`, and `schedule()` picks one step's work:

  1. every running sequence that only needs its newest token computed gets it (a decode, 1 token):
     all of them, every step. This is iteration-level batching: a request joins or leaves the
     batch at any step, instead of waiting for the whole batch to finish;
  2. running sequences still in their prompt get their next chunk, within the step's token budget;
  3. waiting sequences are admitted, in arrival order, while the budget and the free blocks allow.

Decodes go first and prompts are cut into chunks, so one long prompt cannot stall the others'
tokens: each step costs at most `max_num_batched_tokens` tokens of compute.

When a decode needs a new block and the pool is empty, the most recently admitted running sequence
is preempted: its blocks are freed and it goes back to the *front* of `waiting`, keeping its
tokens; when readmitted it recomputes them as a prompt (the prefix cache often still has most of
them). Nothing is lost and nothing crashes; the cost is recomputation.

The scheduler knows nothing about text or tensors.
"""

from collections import deque
from dataclasses import dataclass, field
from enum import Enum

import torch

from qwen3_scratch.sampling.params import SamplingParams

from .block_manager import BlockManager


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    token_ids: list[int]  # prompt then output; grows by one token per sampled step
    num_prompt_tokens: int
    params: SamplingParams
    max_tokens: int  # new tokens at most: params.max_tokens clipped to the context
    eos_ids: frozenset[int]
    generator: torch.Generator | None = None  # a seeded request's own RNG
    status: Status = Status.WAITING
    num_computed: int = 0  # leading tokens whose keys/values are in the cache
    num_cached_prompt: int = 0  # of those, served from the prefix cache at the last admission
    block_table: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" or "length" once finished ("abort" if cancelled)
    num_preemptions: int = 0
    index: int = 0  # which of its request's n choices this is
    after: "Sequence | None" = None  # a sibling whose prompt must be cached first, so this one shares its blocks
    sampling: object | None = None  # the sampler's per-sequence state (engine/sampler.py), if any
    speculation: object | None = None  # its prompt lookup and back-off, when the engine speculates (speculative.py)
    # its newest token while it is still on the device: (the step's tokens, this sequence's row), set by an
    # overlapped step (engine.py) and cleared when the host reads it back. It counts in num_tokens, not token_ids.
    pending: tuple[torch.Tensor, int] | None = None

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        """len(output_ids), without copying them."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_tokens(self) -> int:
        """Its tokens, the one still on the device included."""
        return len(self.token_ids) + (self.pending is not None)

    @property
    def num_uncomputed(self) -> int:
        """Tokens still to run through the model: the rest of the prompt, or just the newest token."""
        return self.num_tokens - self.num_computed

    @property
    def last_pending(self) -> bool:
        """Its token still on the device is its last (max_tokens): no step needs to run it."""
        return self.pending is not None and self.num_output_tokens + 1 >= self.max_tokens


@dataclass
class Chunk:
    """A sequence's tokens [start, end) to run this step; `samples` if end reaches its newest token.
    A decode may carry proposed tokens to check after its newest one (speculative.py): they run at
    positions end.., and only those the step keeps join the sequence."""

    seq: Sequence
    start: int
    end: int
    proposed: list[int] = field(default_factory=list)

    @property
    def new_ids(self) -> list[int]:
        """The tokens this row runs that the host knows: the sequence's [start, end), then its proposals (a
        newest token still on the device is not among them: batch.pack reads it there)."""
        return self.seq.token_ids[self.start : self.end] + self.proposed

    @property
    def samples(self) -> bool:
        return self.end == self.seq.num_tokens


@dataclass
class ScheduledBatch:
    decodes: list[Chunk] = field(default_factory=list)  # a newest token each (and its proposals, if speculating)
    prefills: list[Chunk] = field(default_factory=list)  # prompt chunks: one forward each
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.decodes and not self.prefills


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int = 64, max_num_batched_tokens: int = 512):
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()  # in admission order: preemption takes from the right

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        for seq in list(self.running):  # 1. decodes
            if seq.status is Status.RUNNING and seq.num_uncomputed == 1 and budget > 0 and not seq.last_pending:
                if self._make_room(seq, batch):
                    batch.decodes.append(Chunk(seq, seq.num_computed, seq.num_tokens))
                    budget -= 1
        for seq in list(self.running):  # 2. prompts already started
            if seq.status is Status.RUNNING and seq.num_uncomputed > 1 and budget > 0:
                budget -= self._add_prefill(seq, budget, batch)
        # 3. admissions; none in a step that preempted: the pool is short, and readmitting what was just
        # preempted would only recompute it and preempt it again
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not batch.preempted:
            seq = self.waiting[0]
            if seq.pending is not None:
                break  # preempted with its newest token on the device: readmitted once the host has it
            if seq.after is not None and seq.after.status is not Status.FINISHED:
                if seq.after.num_computed < seq.after.num_prompt_tokens:
                    break  # its sibling's prompt blocks are not cached yet: share them in a step or two
            # A request scoring its prompt needs logits at every prompt position: no cached prefix for it.
            cache = not seq.wants_prompt_logprobs
            # one block spare for its first decode, so a fresh admission does not preempt at once
            if not self.blocks.can_allocate(seq.token_ids, reserve=1 if self.running else 0, use_cache=cache):
                break
            self.waiting.popleft()
            seq.block_table, seq.num_computed = self.blocks.allocate(seq.token_ids, use_cache=cache)
            seq.num_cached_prompt = seq.num_computed
            seq.status = Status.RUNNING
            self.running.append(seq)
            budget -= self._add_prefill(seq, budget, batch)
        return batch

    def _add_prefill(self, seq: Sequence, budget: int, batch: ScheduledBatch) -> int:
        n = min(seq.num_uncomputed, budget)
        batch.prefills.append(Chunk(seq, seq.num_computed, seq.num_computed + n))
        return n

    def _make_room(self, seq: Sequence, batch: ScheduledBatch) -> bool:
        """Give seq a slot for its newest token, preempting others (or seq itself) until one is free."""
        while not self.blocks.ensure_capacity(seq.block_table, seq.num_tokens):
            victim = self.running[-1]
            self.preempt(victim)
            batch.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def preempt(self, seq: Sequence) -> None:
        """Free seq's blocks and put it back at the front of waiting; it will recompute its tokens."""
        self.running.remove(seq)
        self.blocks.free_table(seq.block_table)
        seq.status, seq.num_computed = Status.WAITING, 0
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)

    def computed(self, chunk: Chunk) -> None:
        """The step wrote chunk's keys/values: advance, and seal the blocks that are now full."""
        seq = chunk.seq
        seq.num_computed = chunk.end
        self.seal(seq)

    def seal(self, seq: Sequence) -> None:
        """Seal seq's full blocks whose tokens the host knows (a token still on the device waits for its read)."""
        self.blocks.seal_full_blocks(seq.block_table, seq.token_ids, min(seq.num_computed, len(seq.token_ids)))

    def finish(self, seq: Sequence, reason: str) -> None:
        """Retire seq at once: its blocks go back to the pool (their hashes stay, for reuse)."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        self.blocks.free_table(seq.block_table)
        seq.status, seq.finish_reason = Status.FINISHED, reason
