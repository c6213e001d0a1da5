"""The engine: requests in at any time, tokens out step by step, continuous batching underneath.

    engine = LLMEngine(model, tokenizer, eos_ids=[...], num_blocks=512)
    engine.add_request("a", prompt_ids, SamplingParams(temperature=0, max_tokens=32))
    while engine.has_unfinished():
        for out in engine.step():          # one scheduled step: every running request moves on
            print(out.request_id, out.new_token_ids, out.new_text, out.finished)

One `step()`: the scheduler picks this step's chunks (scheduler.py), the runner runs them through
the model over the paged cache (model_runner.py, paged_cache.py), each sequence that reached its
newest token samples one more with its own settings and generator, and sequences that hit EOS, a
stop string, max_tokens or the context end are retired at once, returning their blocks.

The tokenizer is used only to turn each sequence's tokens into text (for stop strings and
streaming); scheduling and the model never see text.

A fault in one request's forward pass, sampling or text fails that request alone (a StepOutput with
finish_reason "error" and the exception); a fault in scheduling, shared by all, propagates: the
engine cannot go on (faults.py says where that line runs, and why).
"""

import logging
from dataclasses import dataclass

import torch

from qwen3_scratch.errors import GenerationError
from qwen3_scratch.model.qwen3 import Qwen3
from qwen3_scratch.sampling.logits import filter_logits
from qwen3_scratch.sampling.params import SamplingParams
from qwen3_scratch.text.stop import TextState
from qwen3_scratch.text.tokenizer import Tokenizer

from .block_manager import BlockManager
from .faults import Failed, ForwardHealth, each_alone
from .model_runner import ModelRunner
from .paged_cache import PagedKVCache
from .scheduler import Chunk, ScheduledBatch, Scheduler, Sequence

log = logging.getLogger("qwen3_scratch.engine")


@dataclass
class StepOutput:
    """What one step did for one request."""

    request_id: str
    new_token_ids: list[int]
    new_text: str  # text made final by this step (held back while it could still begin a stop string)
    finished: bool
    finish_reason: str | None  # "stop", "length", or "error" (then `error` says why)
    seq: Sequence
    error: BaseException | None = None  # the fault that failed this request alone


class LLMEngine:
    def __init__(
        self,
        model: Qwen3,
        tokenizer: Tokenizer | None,
        eos_ids: list[int],
        num_blocks: int = 512,
        block_size: int = 16,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 512,
    ):
        self.model, self.tokenizer, self.eos_ids = model, tokenizer, frozenset(eos_ids)
        self.context = model.config.max_position_embeddings
        self.cache = PagedKVCache(model.config, num_blocks, block_size, model.device, model.activation_dtype)
        self.blocks = BlockManager(num_blocks, block_size)
        self.scheduler = Scheduler(self.blocks, max_num_seqs, max(max_num_batched_tokens, max_num_seqs))
        self.runner = ModelRunner(model, self.cache)
        self.sequences: dict[str, Sequence] = {}
        self.texts: dict[str, TextState] = {}
        self.num_preemptions = 0  # over the engine's life (metrics)
        self.num_aborted = 0
        self.num_failed = 0  # requests failed by a fault of their own (faults.py)
        self.forward_health = ForwardHealth()

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        """Queue a request; it joins the running batch at a coming step. Bad requests raise GenerationError."""
        if request_id in self.sequences:
            raise GenerationError(f"request id {request_id!r} is already in use")
        max_tokens = self.check_prompt(prompt_ids, params)
        # RoPE tables for every position this request can reach, built here, between steps, never inside one
        self.model.reserve_positions(len(prompt_ids) + max_tokens)
        generator = torch.Generator(self.runner.device)
        generator.manual_seed(params.seed if params.seed is not None else int(torch.randint(2**62, ()).item()))
        eos = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_ids))
        seq = Sequence(request_id, list(prompt_ids), len(prompt_ids), params, max_tokens, frozenset(eos), generator)
        self.sequences[request_id] = seq
        if self.tokenizer is not None:
            self.texts[request_id] = TextState(self.tokenizer, params.stop, params.skip_special_tokens)
        self.scheduler.add(seq)
        return seq

    def check_prompt(self, prompt_ids: list[int], params: SamplingParams) -> int:
        """The request's max_tokens, clipped to the context (None: all that fit); raises if it can never run."""
        if not prompt_ids:
            raise GenerationError("the prompt is empty; send at least one token")
        if len(prompt_ids) >= self.context:
            raise GenerationError(
                f"the prompt is {len(prompt_ids)} tokens but the model's context is {self.context}; shorten the prompt"
            )
        if any(not 0 <= i < self.model.config.vocab_size for i in prompt_ids):
            raise GenerationError(f"prompt token ids must be in [0, {self.model.config.vocab_size})")
        if any(not 0 <= i < self.model.config.vocab_size for i in params.stop_token_ids):
            raise GenerationError(f"stop_token_ids must be in [0, {self.model.config.vocab_size}), the vocabulary")
        # The most tokens one sequence can ever hold: the context, or the whole pool if that is smaller.
        capacity = min(self.context, self.blocks.num_blocks * self.blocks.block_size)
        if params.max_tokens is None:  # "as many as fit"
            if len(prompt_ids) >= capacity:
                self._too_big(len(prompt_ids) + 1)
            return capacity - len(prompt_ids)
        max_tokens = min(params.max_tokens, self.context - len(prompt_ids))  # the context end stops it anyway
        if len(prompt_ids) + max_tokens > capacity:
            self._too_big(len(prompt_ids) + max_tokens)
        return max_tokens

    def _too_big(self, tokens: int):
        needed = self.blocks.blocks_for(tokens)
        raise GenerationError(
            f"the request needs up to {needed} KV blocks but the pool has {self.blocks.num_blocks}; "
            "lower max_tokens or start the engine with more blocks (--num-blocks)"
        )

    def abort(self, request_id: str) -> None:
        """Drop a request wherever it is (a client went away); its blocks return to the pool."""
        seq = self.sequences.pop(request_id, None)
        self.texts.pop(request_id, None)
        if seq is not None:
            self.scheduler.finish(seq, "abort")
            self.num_aborted += 1

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[StepOutput]:
        batch = self.scheduler.schedule()  # shared state: a fault here propagates (the engine is dead)
        self.num_preemptions += len(batch.preempted)
        if batch.empty:
            return []
        chunks = batch.decodes + batch.prefills
        rows = each_alone(lambda some: self._forward(batch, some), chunks)  # logits (V,), None, or Failed
        self.forward_health.record(rows)
        outputs = [self.fail(chunk.seq, row.error) for chunk, row in zip(chunks, rows) if isinstance(row, Failed)]
        ran = [(chunk, row) for chunk, row in zip(chunks, rows) if not isinstance(row, Failed)]
        for chunk, _ in ran:
            self.scheduler.computed(chunk)
        sampling = [(chunk.seq, row) for chunk, row in ran if chunk.samples]
        tokens = each_alone(lambda some: self.sample([seq for seq, _ in some], [row for _, row in some]), sampling)
        for (seq, _), token in zip(sampling, tokens):
            outputs.append(self.fail(seq, token.error) if isinstance(token, Failed) else self._append_or_fail(seq, token))
        return outputs

    def _forward(self, batch: ScheduledBatch, chunks: list[Chunk]) -> list[torch.Tensor | None]:
        """Run some of batch's chunks, each the way the batch would (decodes together, prompts alone)."""
        part = ScheduledBatch([c for c in batch.decodes if c in chunks], [c for c in batch.prefills if c in chunks])
        logits = self.runner.run(part)
        return [logits.get(id(chunk.seq)) for chunk in chunks]

    def _append_or_fail(self, seq: Sequence, token: int) -> StepOutput:
        try:
            return self.append(seq, token)
        except Exception as error:
            return self.fail(seq, error)

    def fail(self, seq: Sequence, error: BaseException) -> StepOutput:
        """Retire seq after a fault of its own; its blocks return to the pool, the others go on."""
        log.error("request %s failed inside the engine; the other requests go on", seq.request_id, exc_info=error)
        self.scheduler.finish(seq, "error")
        self.sequences.pop(seq.request_id, None)
        self.texts.pop(seq.request_id, None)
        self.num_failed += 1
        return StepOutput(seq.request_id, [], "", True, "error", seq, error)

    def sample(self, seqs: list[Sequence], rows: list[torch.Tensor]) -> list[int]:
        """One token per sequence. Rows with the same filter share its work; each draws with its own
        generator, so a seeded request gets the same tokens whatever else is in the batch."""
        if not seqs:
            return []
        logits = torch.stack(rows)  # (N, V)
        tokens = logits.argmax(dim=-1).tolist()  # greedy rows are done
        groups: dict = {}
        for i, seq in enumerate(seqs):
            if not seq.params.logits_filter.greedy:
                groups.setdefault(seq.params.logits_filter, []).append(i)
        for params, index in groups.items():
            probs = filter_logits(logits[index], params).softmax(dim=-1)  # (n, V)
            for row, i in enumerate(index):
                noise = torch.empty_like(probs[row]).exponential_(generator=seqs[i].generator)
                # the same exponential race as sampling.sample: argmax(p / E) is a draw from p
                tokens[i] = int((probs[row] / noise.clamp_min_(torch.finfo(noise.dtype).tiny)).argmax())
        return tokens

    def append(self, seq: Sequence, token: int) -> StepOutput:
        seq.token_ids.append(token)
        text = self.texts.get(seq.request_id)
        stopped = text.push(token) if text is not None else False
        reason = None
        if stopped or token in seq.eos_ids:
            reason = "stop"
        elif len(seq.output_ids) >= seq.max_tokens or len(seq.token_ids) >= self.context:
            reason = "length"
        if reason is not None:
            self.scheduler.finish(seq, reason)
            self.sequences.pop(seq.request_id, None)
            self.texts.pop(seq.request_id, None)
        piece = text.take(reason is not None, stopped) if text is not None else ""
        return StepOutput(seq.request_id, [token], piece, reason is not None, reason, seq)
