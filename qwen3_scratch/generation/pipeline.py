"""Text in, text out: the small Python API that the CLI, the notebook and the tests share.

    pipe = Pipeline.load("Qwen/Qwen3-0.6B")            # download (once) and load
    for piece in pipe.stream("Explain KV cache in one sentence."):
        print(piece, end="", flush=True)
    print(pipe.last_stats.line())

It glues the stages together (checkpoint -> tokenizer + chat template -> token ids -> generate_tokens
-> streaming detokenizer) and measures the run; each stage lives in its own module.
"""

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from .chat_parser import Delta
from .conversation import Conversation
from .errors import GenerationError
from .generate import generate_tokens
from .hub import resolve_checkpoint
from .inputs import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_MODEL,
    MAX_BYTES_PER_TOKEN,
    canonical_dtype,
    check_prompt,
    count_tokens_upto,
)
from .sampling import (
    NON_FINITE,
    check_min_p,
    check_temperature,
    check_top_k,
    check_top_p,
    load_generation_config,
    resolve_sampling_params,
    stop_token_ids,
)
from .stats import (
    GenerationStats,
    bytes_per_decode_step,
    measure_bandwidth,
    peak_memory_bytes,
    reset_peak_memory,
    synchronize,
)
from .tokenizer import StreamingDetokenizer, Tokenizer
from .weights import load_model

CPU_COMPILE_REFUSAL = (
    "--compile is for CUDA (it replays decode as one CUDA graph); on a CPU the decode's matrix-vector "
    "products are already compiled at load, and compiling the whole step was measured 2x slower after "
    "2 minutes of compiling (docs/performance.md); drop --compile"
)
__all__ = ["DEFAULT_MODEL", "DEFAULT_BATCH_SIZE", "GenerationRequest", "Pipeline"]
MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed takes a 64-bit unsigned seed


@dataclass
class GenerationRequest:
    """Everything a generation needs besides the prompts; None means "the checkpoint's default"."""

    max_new_tokens: int = 256
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    seed: int | None = None
    use_cache: bool = True
    ignore_eos: bool = False
    compile: bool = False
    measure_bandwidth: bool = False

    def __post_init__(self):
        """Every value is checked here, before anything loads: errors name the CLI flag."""
        ok = isinstance(self.max_new_tokens, int) and not isinstance(self.max_new_tokens, bool)
        if not ok or self.max_new_tokens < 1:
            raise GenerationError(f"--max-new-tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        for value, check in ((self.temperature, check_temperature), (self.top_k, check_top_k),
                             (self.top_p, check_top_p), (self.min_p, check_min_p)):  # fmt: skip
            if value is not None:
                check(value)
        seed = self.seed
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed <= MAX_SEED):
            raise GenerationError(f"--seed must be an integer from 0 to 2**64 - 1, got {seed!r}")


def pick_device(device: str = "auto") -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise GenerationError("--device cuda: no CUDA GPU is available; use --device cpu")
    if device not in ("cpu", "cuda"):
        raise GenerationError(f"--device must be auto, cpu or cuda, got {device!r}")
    return device


def pick_dtype(dtype: str, device: str) -> str:
    """torch's name for `dtype` (aliases such as half, bf16 and fp32 accepted). auto: bf16 on a GPU, and on
    a CPU with native bf16 (avx512_bf16 or AMX), where decode reads half the bytes of fp32 and, with
    prepacked weights, runs measurably faster (docs/performance.md); fp32 on other CPUs, where bf16
    matmuls are emulated and slower than fp32 ones."""
    dtype = canonical_dtype(dtype)
    if dtype == "auto":
        return "bfloat16" if device == "cuda" or cpu_has_native_bf16() else "float32"
    return dtype


def cpu_has_native_bf16() -> bool:
    """True when the CPU multiplies bf16 in hardware (avx512_bf16 / AMX) and oneDNN will use it."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux: trust oneDNN's own check alone
        flags = "avx512_bf16"
    native = "avx512_bf16" in flags or "amx_bf16" in flags
    return native and torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


class Pipeline:
    def __init__(self, model, tokenizer: Tokenizer, checkpoint: Path):
        self.model, self.tokenizer, self.checkpoint = model, tokenizer, Path(checkpoint)
        tokenizer.check_fits_model(model.config.vocab_size, self.checkpoint)
        self.generation_config = load_generation_config(self.checkpoint, model.config.vocab_size)
        self.last_stats: GenerationStats | None = None
        self.last_stop_reason: str | None = None
        self._conversation: Conversation | None = None

    @classmethod
    def load(cls, model=DEFAULT_MODEL, weights_dir="weights", local_files_only=False, device="auto", dtype="auto",
             *, revision=None, verify=False, quantize=None):  # fmt: skip
        folder = resolve_checkpoint(model, weights_dir, local_files_only=local_files_only, revision=revision,
                                    verify=verify)  # fmt: skip
        device = pick_device(device)
        tokenizer = Tokenizer.from_checkpoint(folder)
        weights = load_model(folder, device, pick_dtype(dtype, device), optimize="decode", quantize=quantize)
        return cls(weights, tokenizer, folder)

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
        """Refuse a text that cannot fit the context, cheaply, before it is fully tokenized: first by
        its length (MAX_BYTES_PER_TOKEN per token at most), then by tokenizing only about as much of
        it as the context holds. (The exact count, template included, is checked when it runs.)"""
        context = self.model.config.max_position_embeddings
        if len(text) > context * MAX_BYTES_PER_TOKEN:
            raise GenerationError(f"{what} is {len(text):,} characters, more than the model's context of {context} "
                                  f"tokens can hold at {MAX_BYTES_PER_TOKEN} per token; shorten the prompt")  # fmt: skip
        check_prompt(text, what)  # UTF-8 (no lone surrogates) and the reading limit, as the CLI's input
        if len(text) >= context and (n := count_tokens_upto(self.tokenizer.encode, text, context)) >= context:
            raise GenerationError(f"{what} is at least {n} tokens but the model's context is {context}; shorten the prompt")

    def stream_ids(self, prompts: list[list[int]], request: GenerationRequest) -> Iterator[list[int]]:
        """Yield each step's new token per row (-1 for finished rows), timing the run into last_stats.

        Logits that turn NaN or inf raise GenerationError at that step, naming it (sample() marks the
        row on the device; the .tolist() that streaming needs anyway is where we see the mark)."""
        if request.compile and self.device.type == "cpu":
            raise GenerationError(CPU_COMPILE_REFUSAL)
        params = resolve_sampling_params(
            self.generation_config, request.temperature, request.top_k, request.top_p, request.min_p
        )
        generator = None
        if request.seed is not None:
            generator = torch.Generator(self.device).manual_seed(request.seed)
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        reset_peak_memory(self.device)
        start = time.perf_counter()
        ttft, steps, generated, first = None, 0, 0, 0
        tokens = generate_tokens(
            self.model, prompts, request.max_new_tokens, params, self.eos_ids, generator,
            use_cache=request.use_cache, ignore_eos=request.ignore_eos, pad_id=pad_id, compile=request.compile,
        )  # fmt: skip
        for step_tokens in tokens:
            row_tokens = step_tokens.tolist()  # the host sync streaming needs
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
        synchronize(self.device)
        elapsed = time.perf_counter() - start
        self._record(prompts, request, steps, generated, generated - first, elapsed, ttft or elapsed)

    def _record(self, prompts, request, steps, generated, decode_tokens, elapsed, ttft):
        width = max(len(p) for p in prompts)
        context = self.model.config.max_position_embeddings
        self.last_stop_reason = "context" if width + steps >= context else None
        config = self.model.config
        self.last_stats = GenerationStats(
            prompt_tokens=sum(len(p) for p in prompts),
            generated_tokens=generated,
            elapsed_seconds=elapsed,
            ttft_seconds=ttft,
            decode_steps=max(steps - 1, 0),
            decode_tokens=decode_tokens,
            batch_size=len(prompts),
            device=str(self.device),
            dtype=str(self.model.lm_head.weight.dtype).removeprefix("torch."),
            peak_memory_bytes=peak_memory_bytes(self.device),
            # the cache grows during decode; its mean length is what a step reads on average
            bytes_per_step=bytes_per_decode_step(self.model, config, width + steps // 2, len(prompts)),
            bandwidth_bytes_per_second=measure_bandwidth(self.device) if request.measure_bandwidth else None,
        )

    def stream(self, prompt: str, request: GenerationRequest | None = None, **template) -> Iterator[str]:
        """Yield text pieces of one completion as they are generated (never half a character)."""
        request = request or GenerationRequest()
        ids = self.prompt_ids(prompt, **template)
        detok = StreamingDetokenizer(self.tokenizer, skip_special_tokens=True)
        self.last_prompt_ids, self.last_ids = ids, []  # for counting reasoning tokens afterwards
        for (token,) in self.stream_ids([ids], request):
            if token >= 0:
                self.last_ids.append(token)
            if token >= 0 and (piece := detok.push(token)):
                yield piece
        if tail := detok.flush():
            yield tail

    def generate(self, prompts: list[str], request: GenerationRequest | None = None,
                 batch_size: int = DEFAULT_BATCH_SIZE, **template) -> list[str]:  # fmt: skip
        """Complete several prompts, batch_size at a time; returns one text per prompt."""
        return [text for texts in self.generate_batches(prompts, request, batch_size, **template) for text in texts]

    def generate_batches(self, prompts: list[str], request: GenerationRequest | None = None,
                         batch_size: int = DEFAULT_BATCH_SIZE, **template) -> Iterator[list[str]]:  # fmt: skip
        """Yield the texts of prompts[0:batch_size], then of the next batch_size, ... as each batch
        ends; last_stats and last_stop_reason describe the batch just yielded.

        Each batch is one left-padded generation with its own KV cache, so memory follows batch_size,
        not len(prompts), and a prompt is tokenized only when its batch runs.
        """
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise GenerationError(f"--batch-size must be an integer >= 1, got {batch_size!r}")
        request = request or GenerationRequest()
        for start in range(0, len(prompts), batch_size):
            chunk = prompts[start : start + batch_size]
            batch = [self.prompt_ids(p, **template, what=f"prompt {start + i + 1}") for i, p in enumerate(chunk)]
            outputs: list[list[int]] = [[] for _ in chunk]
            for row_tokens in self.stream_ids(batch, request):
                for row, token in enumerate(row_tokens):
                    if token >= 0:
                        outputs[row].append(token)
            yield [self.tokenizer.decode(ids, skip_special_tokens=True) for ids in outputs]

    @property
    def conversation(self) -> Conversation:
        """The chat state: one KV cache kept across chat turns (conversation.py)."""
        if self._conversation is None:
            self._conversation = Conversation(self.model, self.tokenizer, self.eos_ids, self.generation_config)
        return self._conversation

    def chat_stream(self, messages: list[dict], request: GenerationRequest | None = None, tools=None,
                    thinking: bool = True) -> Iterator[Delta]:  # fmt: skip
        """Yield the assistant's reply to `messages` as typed pieces: reasoning text, answer text, finished
        tool calls. The KV cache of the previous turn is reused as far as the two prompts agree;
        `self.conversation.last_message` is the reply (also after the stream is closed early)."""
        request, conversation = request or GenerationRequest(), self.conversation
        try:
            yield from conversation.stream(messages, request, tools, thinking)
        finally:
            if (turn := conversation.last_stats) is not None:
                steps = turn.generated_tokens
                self._record([conversation.last_prompt], request, steps, steps, max(steps - 1, 0),
                             turn.elapsed_seconds, turn.ttft_seconds)  # fmt: skip

    def chat(self, messages: list[dict], request: GenerationRequest | None = None, tools=None,
             thinking: bool = True) -> dict:  # fmt: skip
        """The assistant's reply to `messages`: {"role": "assistant", "content", "reasoning_content",
        ["tool_calls"]}. Append it and the next user message to continue the conversation."""
        for _ in self.chat_stream(messages, request, tools, thinking):
            pass
        return self.conversation.last_message
