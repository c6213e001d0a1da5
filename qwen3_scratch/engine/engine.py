"""The engine: requests in at any time, tokens out step by step, continuous batching underneath.

    engine = LLMEngine(model, tokenizer, eos_ids=[...], num_blocks=512)
    engine.add_request("a", prompt_ids, SamplingParams(temperature=0, max_tokens=32))
    while engine.has_unfinished():
        for out in engine.step():          # one scheduled step: every running request moves on
            print(out.request_id, out.new_token_ids, out.new_text, out.finished)

One `step()`: the scheduler picks this step's chunks (scheduler.py), the runner runs them through
the model over the paged cache (model_runner.py, paged_cache.py), each sequence that reached its
newest token samples one more with its own settings and generator (sampler.py: grammar, logit
processing, logprobs), and sequences that hit EOS, a stop string, max_tokens or the context end are
retired at once, returning their blocks. With a speculative_config, decodes first carry proposals
(prompt lookup's, or a draft model's) into the forward and keep what the target agrees with
(speculative.py). A request with n > 1 is n sequences under one request id, told apart by their index; the second and later wait for the first one's prompt to be cached.

Overlapped steps (`async_scheduling`, the default on a GPU; vLLM's async scheduling): a step draws its tokens
on the device and leaves them there, then reads back the step before's and returns those. The next step reads
its input ids from the device (batch.pack, transfer.py), so the host schedules, packs and queues step n+1 and
then turns step n's tokens into text while the GPU computes. A sequence is queued for a step before the host
knows that its newest token was EOS or completed a stop string: that row is computed and dropped. Steps whose
rows need their token on the host before the next forward (a grammar, logit processing, logprobs,
speculation) read it at once.

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
from qwen3_scratch.sampling.logprobs import TokenLogprob
from qwen3_scratch.sampling.params import MAX_SEED, SamplingParams
from qwen3_scratch.sampling.structured import GrammarCompiler
from qwen3_scratch.text.bad_words import bad_words_ids
from qwen3_scratch.text.stop import TextState
from qwen3_scratch.text.tokenizer import Tokenizer

from . import sampler
from .block_manager import BlockManager
from .faults import Failed, ForwardHealth, each_alone
from .model_runner import ModelRunner
from .paged_cache import PagedKVCache
from .scheduler import Chunk, ScheduledBatch, Scheduler, Sequence, Status
from .speculative import Speculator
from .speculative_config import SpeculativeConfig
from .transfer import DeviceTokens

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
    index: int = 0  # which of the request's n choices (each finishes on its own)
    logprobs: list[TokenLogprob] | None = None  # of new_token_ids, when the request asked for logprobs
    error: BaseException | None = None  # the fault that failed this choice alone (finish_reason "error")


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
        speculative_config=None,
        draft_model: Qwen3 | None = None,
        async_scheduling: bool | None = None,
    ):
        """speculative_config: vLLM's, as a dict or JSON (speculative_config.py): prompt lookup (speculative.py) or a
        draft model (draft_proposer.py; draft_model: that model loaded, else loaded from the config's "model").
        None: no speculation. async_scheduling: a step leaves its tokens on the device and returns the step
        before's, so that the host's work overlaps the device's (`_overlapped`); default: on a GPU (on a CPU
        every op has finished when it returns: nothing would overlap, and each output would come a step late)."""
        self.model, self.tokenizer, self.eos_ids = model, tokenizer, frozenset(eos_ids)
        self.context = model.config.max_position_embeddings
        self.cache = PagedKVCache(model.config, num_blocks, block_size, model.device, model.activation_dtype)
        self.blocks = BlockManager(num_blocks, block_size)
        self.scheduler = Scheduler(self.blocks, max_num_seqs, max(max_num_batched_tokens, max_num_seqs))
        self.runner = ModelRunner(model, self.cache, max_rows=max_num_seqs)  # a decode bucket per batch size
        self.sequences: dict[str, list[Sequence]] = {}  # request id -> its unfinished choices
        self.texts: dict[tuple[str, int], TextState] = {}  # (request id, choice index) -> its text
        self._grammars: GrammarCompiler | None = None  # built on the first structured request
        self.num_preemptions = 0  # over the engine's life (metrics)
        self.num_aborted = 0
        self.num_failed = 0  # requests failed by a fault of their own (faults.py)
        self.forward_health = ForwardHealth()
        self.async_scheduling = model.device.type == "cuda" if async_scheduling is None else async_scheduling
        self.in_flight: tuple[list[Sequence], DeviceTokens] | None = None  # an overlapped step's, not read back
        config = SpeculativeConfig.parse(speculative_config)
        self.speculator = Speculator(config, self, draft_model) if config is not None else None

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        """Queue a request: params.n sequences, which join the running batch at a coming step, each
        reported under request_id with its own index. Bad requests raise GenerationError. Returns the first."""
        if request_id in self.sequences:
            raise GenerationError(f"request id {request_id!r} is already in use")
        max_tokens = self.check_prompt(prompt_ids, params)
        # RoPE tables for every position this request can reach, built here, between steps, never inside one
        self.model.reserve_positions(len(prompt_ids) + max_tokens)
        eos = frozenset(set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_ids)))
        base_seed = params.seed if params.seed is not None else int(torch.randint(2**62, ()).item())
        grammar = self.grammars.grammar(params.structured_outputs) if params.structured_outputs else None
        bad_words = bad_words_ids(self.tokenizer, params.bad_words) if params.bad_words else ()
        processing = params.processing(bad_words)
        choices = []
        for index in range(params.n):
            # choice i draws from seed + i (vLLM's rule): n different answers, each reproducible
            generator = torch.Generator(self.runner.device).manual_seed((base_seed + index) % (MAX_SEED + 1))
            seq = Sequence(request_id, list(prompt_ids), len(prompt_ids), params, max_tokens, eos, generator,
                           index=index, after=choices[0] if choices else None)  # fmt: skip
            state = sampler.SamplingState(processing if processing.active else None)
            state.matcher = self.grammars.matcher(grammar, params.structured_outputs) if grammar is not None else None
            seq.sampling = state
            if self.tokenizer is not None:
                self.texts[(request_id, index)] = TextState(self.tokenizer, params.stop, params.skip_special_tokens,
                                                            params.min_tokens)  # fmt: skip
            choices.append(seq)
        self.sequences[request_id] = choices
        for seq in choices:
            self.scheduler.add(seq)
        return choices[0]

    @property
    def grammars(self) -> GrammarCompiler:
        """The grammar engine over this model's vocabulary (structured output), built when first needed."""
        if self._grammars is None:
            if self.tokenizer is None:
                raise GenerationError("structured output needs the engine to have a tokenizer")
            self._grammars = GrammarCompiler(self.tokenizer.backend.to_str(), self.model.config.vocab_size,
                                             sorted(self.eos_ids))  # fmt: skip
        return self._grammars

    def check_prompt(self, prompt_ids: list[int], params: SamplingParams) -> int:
        """The request's max_tokens, clipped to the context (None: all that fit); raises if it can never run."""
        if not prompt_ids:
            raise GenerationError("the prompt is empty; send at least one token")
        if len(prompt_ids) >= self.context:
            raise GenerationError(
                f"the prompt is {len(prompt_ids)} tokens but the model's context is {self.context}; shorten the prompt"
            )
        vocab = self.model.config.vocab_size
        if any(not 0 <= i < vocab for i in prompt_ids):
            raise GenerationError(f"prompt token ids must be in [0, {vocab})")
        if any(not 0 <= i < vocab for i in params.stop_token_ids):
            raise GenerationError(f"stop_token_ids must be in [0, {vocab}), the model's vocabulary")
        if any(not 0 <= i < vocab for i in (params.logit_bias or {})):
            raise GenerationError(f"logit_bias token ids must be in [0, {vocab}), the model's vocabulary")
        if params.structured_outputs is not None:
            if params.ignore_eos:
                raise GenerationError("ignore_eos cannot go with structured output: the grammar ends the output")
            self.grammars.grammar(params.structured_outputs)  # refuses an invalid schema or grammar now
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
        choices = self.sequences.pop(request_id, None)
        if choices is not None:
            for seq in choices:
                self.texts.pop((request_id, seq.index), None)
                self.scheduler.finish(seq, "abort")
                seq.pending = None  # a token still on the device is dropped with it
            self.num_aborted += 1
        if self.in_flight is not None and all(seq.pending is None for seq in self.in_flight[0]):
            self.in_flight = None  # nobody waits for that step's tokens any more

    def has_unfinished(self) -> bool:
        """Requests still queued or running, or an overlapped step's tokens not read back yet."""
        return self.scheduler.has_unfinished() or self.in_flight is not None

    def step(self) -> list[StepOutput]:
        batch = self.scheduler.schedule()  # shared state: a fault here propagates (the engine is dead)
        self.num_preemptions += len(batch.preempted)
        if batch.empty:
            return self.read_back()  # the last overlapped step's tokens, if any
        if self.speculator is not None:
            self.speculator.propose(batch)  # decodes that find proposals carry them into the forward
        chunks = batch.decodes + batch.prefills
        rows = each_alone(lambda some: self._forward(batch, some), chunks)  # (logits, prompt logits), or Failed
        self.forward_health.record(rows)
        outputs = [self.fail(chunk.seq, row.error) for chunk, row in zip(chunks, rows) if isinstance(row, Failed)]
        sampling = []
        for chunk, row in zip(chunks, rows):
            if isinstance(row, Failed):
                continue
            self.scheduler.computed(chunk)
            logits, prompt_logits = row
            try:
                if prompt_logits is not None:
                    sampler.score_prompt(chunk.seq, prompt_logits, chunk.start)
            except Exception as error:
                outputs.append(self.fail(chunk.seq, error))
                continue
            if chunk.proposed:
                outputs.append(self._speculated(chunk, logits))
            elif chunk.samples:
                sampling.append((chunk.seq, logits))
        if self.overlaps(sampling) and (overlapped := self._overlapped(sampling)) is not None:
            return outputs + overlapped
        outputs += self.read_back()
        tokens = each_alone(lambda some: sampler.sample([seq for seq, _ in some], [row for _, row in some]), sampling)
        for (seq, row), token in zip(sampling, tokens):
            outputs.append(self.fail(seq, token.error) if isinstance(token, Failed) else self._record_and_append(seq, row, token))
        return outputs

    def overlaps(self, sampling: list[tuple[Sequence, torch.Tensor]]) -> bool:
        """Whether this step's tokens may stay on the device until the next step is queued: with
        async_scheduling, when no row needs its token on the host before the next forward (a grammar's mask,
        logit processing, logprobs) and the engine does not speculate (proposals are made from the tokens)."""
        return self.async_scheduling and self.speculator is None and all(
            (seq.sampling is None or not seq.sampling.active) and seq.params.logprobs is None for seq, _ in sampling
        )

    def _overlapped(self, sampling: list[tuple[Sequence, torch.Tensor]]) -> list[StepOutput] | None:
        """Draw this step's tokens on the device and leave them there; then read back the step before's.

        The next step feeds them to its forward from the device (batch.pack), so on a GPU the host's work on
        them (text, stop strings, finishing, the StepOutputs) and its scheduling of the next step run while
        the GPU runs this one. A sequence that the read back finishes (EOS, a stop string) may already be in
        the step queued after: its row there is computed and dropped. Its blocks go back to the pool at once;
        a forward still queued writes them before any later one reads them (one stream, in order). None if the
        draw raised."""
        seqs = [seq for seq, _ in sampling]
        try:
            tokens = DeviceTokens(sampler.draw(seqs, [row for _, row in sampling])) if sampling else None
        except Exception:  # a row whose draw raises: None, and the step samples as if not overlapped (each_alone)
            return None
        outputs = self.read_back()
        kept = False
        for row, seq in enumerate(seqs):
            if seq.status is not Status.FINISHED:  # not finished by the read back (EOS, a stop string) or failed
                seq.pending, kept = (tokens.on_device, row), True
        self.in_flight = (seqs, tokens) if kept else None
        return outputs

    def read_back(self) -> list[StepOutput]:
        """The last overlapped step's tokens, read to the host and appended: what that step's outputs are."""
        if self.in_flight is None:
            return []
        (seqs, tokens), self.in_flight = self.in_flight, None
        try:
            values = tokens.tolist()
        except Exception as error:  # the draw's kernels failed on the device: every row of it fails
            values = [Failed(error)] * len(seqs)
        outputs = []
        for seq, token in zip(seqs, values):
            if seq.pending is None:
                continue  # finished before its draw was kept
            seq.pending = None
            if seq.status is Status.FINISHED:
                continue  # aborted, or failed in the step queued after: its token is dropped
            failed = isinstance(token, Failed)
            outputs.append(self.fail(seq, token.error) if failed else self._record_and_append(seq, None, token))
        return outputs

    def _forward(self, batch: ScheduledBatch, chunks: list[Chunk]) -> list[tuple]:
        """Run some of batch's chunks, each the way the batch would (decodes together, prompts alone):
        per chunk (its next-token logits (V,) or None, its prompt's logits (T, V) if it scores them)."""
        chosen = {id(c) for c in chunks}  # by identity: a Chunk's == compares its sequence field by field
        part = ScheduledBatch([c for c in batch.decodes if id(c) in chosen],
                              [c for c in batch.prefills if id(c) in chosen])
        logits = self.runner.run(part)
        prompt = self.runner.prompt_logits  # this run's
        return [(logits.get(id(chunk.seq)), prompt.get(id(chunk.seq))) for chunk in chunks]

    def _speculated(self, chunk: Chunk, logits: torch.Tensor) -> StepOutput:
        """A speculative row's tokens, kept and resampled from its logits (1+k, V), as one StepOutput."""
        try:
            outputs = self.speculator.accept(chunk, logits)
        except Exception as error:
            return self.fail(chunk.seq, error)
        last = outputs[-1]
        return StepOutput(last.request_id, [t for out in outputs for t in out.new_token_ids],
                          "".join(out.new_text for out in outputs), last.finished, last.finish_reason, last.seq,
                          last.index)  # fmt: skip

    def _record_and_append(self, seq: Sequence, row: torch.Tensor, token: int) -> StepOutput:
        try:
            sampler.record(seq, row, token)
            return self.append(seq, token)
        except Exception as error:
            return self.fail(seq, error)

    def fail(self, seq: Sequence, error: BaseException) -> StepOutput:
        """Retire one choice after a fault of its own; its blocks return to the pool, the others go on."""
        log.error("request %s (choice %d) failed inside the engine; the other requests go on", seq.request_id,
                  seq.index, exc_info=error)  # fmt: skip
        self.scheduler.finish(seq, "error")
        self._forget(seq)
        self.num_failed += 1
        return StepOutput(seq.request_id, [], "", True, "error", seq, seq.index, error=error)

    def _forget(self, seq: Sequence) -> None:
        """seq is finished: drop its text, and the request once its last choice is done."""
        self.texts.pop((seq.request_id, seq.index), None)
        choices = self.sequences.get(seq.request_id, [])
        if seq in choices:
            choices.remove(seq)
        if not choices:
            self.sequences.pop(seq.request_id, None)

    def append(self, seq: Sequence, token: int) -> StepOutput:
        seq.token_ids.append(token)
        if seq.num_computed == len(seq.token_ids):  # read back after the step that wrote its keys was queued
            self.scheduler.seal(seq)
        key = (seq.request_id, seq.index)
        text = self.texts.get(key)
        stopped = text.push(token) if text is not None else False
        reason = None
        if stopped or token in seq.eos_ids:
            reason = "stop"
        elif seq.num_output_tokens >= seq.max_tokens or len(seq.token_ids) >= self.context:
            reason = "length"
        if reason is not None:
            self.scheduler.finish(seq, reason)
            self._forget(seq)
        piece = text.take(reason is not None, stopped) if text is not None else ""
        logprobs = seq.sampling.logprobs[-1:] if seq.params.logprobs is not None else None
        return StepOutput(seq.request_id, [token], piece, reason is not None, reason, seq, seq.index, logprobs)
