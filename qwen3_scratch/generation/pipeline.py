"""Text in, text out: the Python API over the simple loops, which the CLI, the notebook and the tests share.

    pipe = Pipeline.load("Qwen/Qwen3-0.6B")            # download (once) and load
    for piece in pipe.stream("Explain KV cache in one sentence.", SamplingParams(max_tokens=64)):
        print(piece, end="", flush=True)
    print(pipe.last_stats.line())

It glues the stages together (checkpoint -> tokenizer + chat template -> token ids -> generate_tokens
-> streaming detokenizer and stop strings) and measures the run; each stage lives in its own module.
One prompt or a fixed batch at a time, through the fastest batch-1 path; many requests arriving at
any time are the engine's job (`qwen3_scratch.LLM`, engine/llm.py).
"""

import time
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path

import torch

from qwen3_scratch.checkpoint.hub import resolve_checkpoint
from qwen3_scratch.checkpoint.placement import DEFAULT_MODEL, pick_device, pick_dtype
from qwen3_scratch.checkpoint.weights import load_model
from qwen3_scratch.errors import GenerationError
from qwen3_scratch.parallel.model import load_parallel_model
from qwen3_scratch.sampling.defaults import load_generation_config, stop_token_ids
from qwen3_scratch.sampling.logits import NON_FINITE
from qwen3_scratch.sampling.params import SamplingParams
from qwen3_scratch.text.bad_words import bad_words_ids
from qwen3_scratch.text.chat_parser import Delta
from qwen3_scratch.text.limits import DEFAULT_BATCH_SIZE, check_fits
from qwen3_scratch.text.stop import TextState
from qwen3_scratch.text.tokenizer import Tokenizer

from .conversation import Conversation, ConversationCache
from .draft_model import check_draft_checkpoint
from .loops import generate_tokens, plan_new_tokens
from .speculative import check_speculative, make_speculator
from .stats import (
    GenerationStats,
    bytes_per_decode_step,
    measure_bandwidth,
    peak_memory_bytes,
    reset_peak_memory,
    synchronize,
)

CPU_COMPILE_REFUSAL = (
    "--compile is for CUDA (it replays decode as one CUDA graph); on a CPU the decode's matrix-vector "
    "products are already compiled at load, and compiling the whole step was measured 2x slower after "
    "2 minutes of compiling (docs/performance.md); drop --compile"
)
SPECULATIVE_BATCH = "speculative decoding runs one prompt at a time: use batch_size=1 (--batch-size 1)"
__all__ = ["DEFAULT_BATCH_SIZE", "Pipeline"]
# SamplingParams fields the simple loops do not implement, with the value that means "not asked for"
ENGINE_ONLY = {"n": 1, "logprobs": None, "prompt_logprobs": None, "structured_outputs": None}


class Pipeline:
    """One model, its tokenizer and the simple loops: text in, text (or typed chat pieces) out.

    How every call runs is fixed when the pipeline is made: `use_cache` (False: the full-recompute
    reference loop), `compile` (the decode step compiled by inductor, as CUDA graphs; refused on a CPU),
    `cuda_graphs` (None: each decode step replayed from a CUDA graph where the model is on a GPU, no compile
    needed; False: eager steps, for debugging; generation/cuda_graph.py),
    `measure_bandwidth` (for the stats line's bandwidth_util) and `speculative` ("ngram": prompt
    lookup, or "draft": `draft`, a smaller Qwen3 with the same tokenizer, proposes; at most
    `num_speculative_tokens` a round; generation/speculative.py). What a call samples is its
    `SamplingParams`; None means SamplingParams() with the checkpoint's defaults."""

    def __init__(self, model, tokenizer: Tokenizer, checkpoint: Path, *, use_cache: bool = True,
                 compile: bool = False, measure_bandwidth: bool = False, speculative: str | None = None,
                 draft=None, num_speculative_tokens: int | None = None, cuda_graphs: bool | None = None):  # fmt: skip
        if compile and model.device.type == "cpu":
            raise GenerationError(CPU_COMPILE_REFUSAL)
        check_speculative(speculative, draft, num_speculative_tokens, use_cache, compile)
        self.model, self.tokenizer, self.checkpoint = model, tokenizer, Path(checkpoint)
        self.use_cache, self.compile, self.measure_bandwidth = use_cache, compile, measure_bandwidth
        self.cuda_graphs = cuda_graphs
        self.speculator = make_speculator(speculative, model, draft, num_speculative_tokens)
        tokenizer.check_fits_model(model.config.vocab_size, self.checkpoint)
        self.generation_config = load_generation_config(self.checkpoint, model.config.vocab_size)
        self.last_stats: GenerationStats | None = None
        self.last_stop_reason: str | None = None
        self._conversation: Conversation | None = None

    @classmethod
    def load(cls, model=DEFAULT_MODEL, weights_dir="weights", local_files_only=False, device="auto", dtype="auto",
             *, revision=None, verify=False, quantize=None, quantize_group_size=None, use_cache=True, compile=False,
             measure_bandwidth=False, tensor_parallel_size=1, speculative=None, draft_model=None,
             num_speculative_tokens=None, cuda_graphs=None) -> "Pipeline":  # fmt: skip
        """Resolve `model` (a folder, or a Hub id downloaded into weights_dir), load it laid out for
        batch-1 decode (kernels/layout.py) on `device` in `dtype` (checkpoint/placement.py's rule);
        tensor_parallel_size > 1 splits it over that many processes (parallel/).
        draft_model (with speculative="draft"): the draft's folder or Hub id, loaded the same way."""
        device = pick_device(device)
        if compile and device == "cpu":  # before any download or load
            raise GenerationError(CPU_COMPILE_REFUSAL)
        check_speculative(speculative, draft_model, num_speculative_tokens, use_cache, compile)
        if speculative is not None and tensor_parallel_size != 1:
            raise GenerationError("--speculative runs on one device: drop --tensor-parallel-size or --speculative")
        folder = resolve_checkpoint(model, weights_dir, local_files_only=local_files_only, revision=revision,
                                    verify=verify)  # fmt: skip
        tokenizer = Tokenizer.from_checkpoint(folder)
        layout = dict(optimize="decode", quantize=quantize, quantize_group_size=quantize_group_size)
        dtype = pick_dtype(dtype, device, quantize, layout["optimize"])
        draft = None
        if draft_model is not None:
            draft_folder = resolve_checkpoint(draft_model, weights_dir, local_files_only=local_files_only)
            check_draft_checkpoint(folder, tokenizer, draft_folder)
            draft = load_model(draft_folder, device, dtype, **layout)
        if tensor_parallel_size != 1:  # (0 or -1 are refused there, in one line)
            weights = load_parallel_model(folder, tensor_parallel_size, device, dtype, **layout)
        else:
            weights = load_model(folder, device, dtype, **layout)
        return cls(weights, tokenizer, folder, use_cache=use_cache, compile=compile,
                   measure_bandwidth=measure_bandwidth, speculative=speculative, draft=draft,
                   num_speculative_tokens=num_speculative_tokens, cuda_graphs=cuda_graphs)  # fmt: skip

    def resolve(self, params: SamplingParams | None) -> SamplingParams:
        """params (None: SamplingParams()) with the checkpoint's defaults for what it leaves unset; refuses the
        fields only the engine implements, rather than ignoring them."""
        params = (params or SamplingParams()).with_defaults(self.generation_config)
        for name, off in ENGINE_ONLY.items():
            if getattr(params, name) != off:
                raise GenerationError(f"Pipeline does not implement {name}; use LLM (the engine), which does")
        return params

    def processing(self, params: SamplingParams):
        """The request's logit processing (penalties, bias, min_tokens, bad words) for the loops."""
        words = bad_words_ids(self.tokenizer, params.bad_words) if params.bad_words else ()
        return params.processing(words)

    def stop_ids(self, params: SamplingParams) -> set[int]:
        """The ids that end a row: the request's stop_token_ids, and EOS unless it ignores EOS."""
        return set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_ids))

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def eos_ids(self) -> list[int]:
        return stop_token_ids(self.generation_config, self.model.config.eos_token_ids, self.tokenizer.eos_token_id)

    def prompt_ids(self, prompt: str, system: str | None = None, chat: bool = True, thinking: bool = True,
                   what: str = "the prompt"):  # fmt: skip
        """Token ids for one prompt, wrapped in the checkpoint's chat template unless chat=False.

        In chat mode the prompt and system message are text, even where they spell a control token;
        with chat=False the prompt is the whole raw prompt, control tokens included, written by hand."""
        self.check_fits(prompt, what)
        if system is not None:
            self.check_fits(system, "the system message")
        if not chat:
            return self.tokenizer.encode(prompt)
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        return self.tokenizer.chat_ids(messages, add_generation_prompt=True, enable_thinking=thinking)

    def check_fits(self, text: str, what: str = "the prompt") -> None:
        """Refuse a text that cannot fit the context before it is fully tokenized (text/limits.py)."""
        check_fits(text, what, self.tokenizer.encode, self.model.config.max_position_embeddings)

    def stream_ids(self, prompts: list[list[int]], params: SamplingParams | None = None) -> Iterator[list[int]]:
        """Yield each step's new token per row (-1 for finished rows), timing the run into last_stats
        (also when the caller stops early, at a stop string).

        Logits that turn NaN or inf raise GenerationError at that step, naming it (sample() marks the
        row on the device; the .tolist() that streaming needs anyway is where we see the mark)."""
        params = self.resolve(params)
        generator = None
        if params.seed is not None:
            generator = torch.Generator(self.device).manual_seed(params.seed)
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        max_new = params.max_tokens or self.model.config.max_position_embeddings  # None: all that fit
        reset_peak_memory(self.device)
        start = time.perf_counter()
        ttft, steps, generated, first = None, 0, 0, 0
        try:
            for row_tokens in self._steps(prompts, max_new, params, generator, pad_id):
                if NON_FINITE in row_tokens:
                    raise GenerationError(
                        f"stopped at generated token {steps + 1} (batch row {row_tokens.index(NON_FINITE) + 1}): "
                        f"the model's logits are NaN or inf ({self.model.activation_dtype} overflowed, or the "
                        "weights are damaged); try --dtype float32, or download the checkpoint again"
                    )  # fmt: skip
                if ttft is None:
                    ttft = time.perf_counter() - start
                    first = sum(t >= 0 for t in row_tokens)
                steps += 1
                generated += sum(t >= 0 for t in row_tokens)
                yield row_tokens
        finally:
            if steps:
                synchronize(self.device)
                elapsed = time.perf_counter() - start
                speculation = self.speculator.stats if self.speculator is not None else None
                self._record(prompts, steps, generated, generated - first, elapsed, ttft, speculation)

    def _steps(self, prompts, max_new: int, params: SamplingParams, generator, pad_id: int) -> Iterator[list[int]]:
        """Each step's new token per row: the plain loops (loops.py), or speculation's tokens one at a time."""
        processing = self.processing(params)
        if self.speculator is None or processing.active:  # penalties and the like: one token a step
            for step_tokens in generate_tokens(
                self.model, prompts, max_new, params.logits_filter, self.stop_ids(params), generator,
                use_cache=self.use_cache, pad_id=pad_id, compile=self.compile, processing=processing,
                cuda_graphs=self.cuda_graphs,
            ):  # fmt: skip
                yield step_tokens.tolist()  # the host sync streaming needs
            return
        if len(prompts) > 1:
            raise GenerationError(SPECULATIVE_BATCH)
        n_new = plan_new_tokens(len(prompts[0]), max_new, self.model.config.max_position_embeddings)
        cache = ConversationCache(self.model)  # one sequence's cache, rolled back as proposals are rejected
        for token in self.speculator.generate(cache, prompts[0], n_new, params.logits_filter, generator,
                                              self.stop_ids(params)):  # fmt: skip
            yield [token]

    def _record(self, prompts, steps, generated, decode_tokens, elapsed, ttft, speculation=None):
        width = max(len(p) for p in prompts)
        config = self.model.config
        self.last_stop_reason = "context" if width + steps >= config.max_position_embeddings else None
        self.last_stats = GenerationStats(
            prompt_tokens=sum(len(p) for p in prompts),
            generated_tokens=generated,
            elapsed_seconds=elapsed,
            ttft_seconds=ttft,
            decode_steps=speculation.forwards if speculation is not None else max(steps - 1, 0),
            decode_tokens=decode_tokens,
            batch_size=len(prompts),
            device=str(self.device),
            # int8 or int4 when quantized (an int4 matrix is stored as packed bytes, so its dtype would say uint8)
            dtype=getattr(self.model.lm_head, "scheme", str(self.model.lm_head.weight.dtype).removeprefix("torch.")),
            peak_memory_bytes=peak_memory_bytes(self.device),
            # the cache grows during decode; its mean length is what a step reads on average
            bytes_per_step=bytes_per_decode_step(self.model, config, width + steps // 2, len(prompts)),
            bandwidth_bytes_per_second=measure_bandwidth(self.device) if self.measure_bandwidth else None,
            speculation=speculation,
        )

    def stream(self, prompt: str, params: SamplingParams | None = None, **template) -> Iterator[str]:
        """Yield text pieces of one completion as they are generated (never half a character), ending
        before the first of params.stop."""
        params = self.resolve(params)
        ids = self.prompt_ids(prompt, **template)
        text = TextState(self.tokenizer, params.stop, params.skip_special_tokens, params.min_tokens)
        self.last_prompt_ids, self.last_ids = ids, []  # for counting reasoning tokens afterwards
        stopped = False
        with closing(self.stream_ids([ids], params)) as steps:
            for (token,) in steps:
                if token < 0:
                    continue
                self.last_ids.append(token)
                stopped = text.push(token)
                if piece := text.take(finished=stopped, stopped=stopped):
                    yield piece
                if stopped:
                    return
        if tail := text.take(finished=True, stopped=False):
            yield tail

    def generate(self, prompts: list[str], params: SamplingParams | None = None,
                 batch_size: int = DEFAULT_BATCH_SIZE, **template) -> list[str]:  # fmt: skip
        """Complete several prompts, batch_size at a time; returns one text per prompt."""
        return [text for texts in self.generate_batches(prompts, params, batch_size, **template) for text in texts]

    def generate_batches(self, prompts: list[str], params: SamplingParams | None = None,
                         batch_size: int = DEFAULT_BATCH_SIZE, **template) -> Iterator[list[str]]:  # fmt: skip
        """Yield the texts of prompts[0:batch_size], then of the next batch_size, ... as each batch
        ends; last_stats and last_stop_reason describe the batch just yielded.

        Each batch is one left-padded generation with its own KV cache, so memory follows batch_size,
        not len(prompts), and a prompt is tokenized only when its batch runs. A batch ends when every
        row has met EOS or a stop string (a row past its stop string rides along, its tokens unused).
        """
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise GenerationError(f"--batch-size must be an integer >= 1, got {batch_size!r}")
        if self.speculator is not None and batch_size > 1 and len(prompts) > 1:
            raise GenerationError(SPECULATIVE_BATCH)
        params = self.resolve(params)
        for start in range(0, len(prompts), batch_size):
            chunk = prompts[start : start + batch_size]
            batch = [self.prompt_ids(p, **template, what=f"prompt {start + i + 1}") for i, p in enumerate(chunk)]
            texts = [TextState(self.tokenizer, params.stop, params.skip_special_tokens, params.min_tokens) for _ in chunk]
            stopped = [False] * len(chunk)
            with closing(self.stream_ids(batch, params)) as steps:
                for row_tokens in steps:
                    for row, token in enumerate(row_tokens):
                        if token >= 0 and not stopped[row]:
                            stopped[row] = texts[row].push(token)
                    if all(s or token < 0 for s, token in zip(stopped, row_tokens)):
                        break
            yield [text.take(finished=True, stopped=s) for text, s in zip(texts, stopped)]

    @property
    def conversation(self) -> Conversation:
        """The chat state: one KV cache kept across chat turns (conversation.py)."""
        if self._conversation is None:
            self._conversation = Conversation(self.model, self.tokenizer, self.eos_ids, self.generation_config,
                                              speculator=self.speculator)  # fmt: skip
        return self._conversation

    def chat_stream(self, messages: list[dict], params: SamplingParams | None = None, tools=None,
                    thinking: bool = True, should_stop=None) -> Iterator[Delta]:  # fmt: skip
        """Yield the assistant's reply to `messages` as typed pieces: reasoning text, answer text, finished
        tool calls. The KV cache of the previous turn is reused as far as the two prompts agree;
        `self.conversation.last_message` is the reply (also after the stream is closed early, or ended by
        should_stop, a callable asked after every token: the chat command's Ctrl-C)."""
        conversation = self.conversation
        try:
            params = self.resolve(params)
            yield from conversation.stream(messages, params, tools, thinking, self.processing(params), should_stop)
        finally:
            if (turn := conversation.last_stats) is not None:
                steps = turn.generated_tokens
                self._record([conversation.last_prompt], steps, steps, max(steps - 1, 0),
                             turn.elapsed_seconds, turn.ttft_seconds, turn.speculation)  # fmt: skip

    def chat(self, messages: list[dict], params: SamplingParams | None = None, tools=None,
             thinking: bool = True) -> dict:  # fmt: skip
        """The assistant's reply to `messages`: {"role": "assistant", "content", "reasoning_content",
        ["tool_calls"]}. Append it and the next user message to continue the conversation."""
        for _ in self.chat_stream(messages, params, tools, thinking):
            pass
        return self.conversation.last_message
