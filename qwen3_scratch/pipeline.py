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

from .errors import GenerationError
from .generate import generate_tokens
from .hub import resolve_checkpoint
from .sampling import load_generation_config, resolve_sampling_params
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

DEFAULT_MODEL = "Qwen/Qwen3-0.6B"
CPU_COMPILE_REFUSAL = (
    "--compile is for CUDA (it replays decode as one CUDA graph); on a CPU the eager decode already reads "
    "prepacked weights near the memory bandwidth, and inductor's code was measured slower after minutes of "
    "compiling (docs/performance.md); drop --compile"
)


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


def pick_device(device: str = "auto") -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise GenerationError("--device cuda: no CUDA GPU is available; use --device cpu")
    if device not in ("cpu", "cuda"):
        raise GenerationError(f"--device must be auto, cpu or cuda, got {device!r}")
    return device


def pick_dtype(dtype: str, device: str) -> str:
    """auto: bf16 on a GPU, and on a CPU with native bf16 (avx512_bf16 or AMX), where decode reads half
    the bytes of fp32 and, with prepacked weights, runs measurably faster (docs/performance.md); fp32 on
    other CPUs, where bf16 matmuls are emulated and slower than fp32 ones."""
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
        self.generation_config = load_generation_config(self.checkpoint)
        self.last_stats: GenerationStats | None = None
        self.last_stop_reason: str | None = None

    @classmethod
    def load(cls, model=DEFAULT_MODEL, weights_dir="weights", local_files_only=False, device="auto", dtype="auto",
             quantize=None):  # fmt: skip
        folder = resolve_checkpoint(model, weights_dir, local_files_only=local_files_only)
        device = pick_device(device)
        tokenizer = Tokenizer.from_checkpoint(folder)
        weights = load_model(folder, device, pick_dtype(dtype, device), optimize=True, quantize=quantize)
        return cls(weights, tokenizer, folder)

    @property
    def device(self) -> torch.device:
        return self.model.lm_head.weight.device

    @property
    def eos_ids(self) -> list[int]:
        ids = self.generation_config.get("eos_token_id") or self.model.config.eos_token_ids
        if not ids and self.tokenizer.eos_token_id is not None:
            ids = [self.tokenizer.eos_token_id]
        return list(ids)

    def prompt_ids(self, prompt: str, system: str | None = None, chat: bool = True, thinking: bool = True):
        """Token ids for one prompt, wrapped in the checkpoint's chat template unless chat=False."""
        if not chat:
            return self.tokenizer.encode(prompt)
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=thinking)
        return self.tokenizer.encode(text)

    def stream_ids(self, prompts: list[list[int]], request: GenerationRequest) -> Iterator[list[int]]:
        """Yield each step's new token per row (-1 for finished rows), timing the run into last_stats."""
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
        ttft, steps, generated = None, 0, 0
        tokens = generate_tokens(
            self.model, prompts, request.max_new_tokens, params, self.eos_ids, generator,
            use_cache=request.use_cache, ignore_eos=request.ignore_eos, pad_id=pad_id, compile=request.compile,
        )  # fmt: skip
        for step_tokens in tokens:
            row_tokens = step_tokens.tolist()  # the host sync streaming needs
            if ttft is None:
                ttft = time.perf_counter() - start
            steps += 1
            generated += sum(t >= 0 for t in row_tokens)
            yield row_tokens
        synchronize(self.device)
        elapsed = time.perf_counter() - start
        self._record(prompts, request, steps, generated, elapsed, ttft or elapsed)

    def _record(self, prompts, request, steps, generated, elapsed, ttft):
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
        for (token,) in self.stream_ids([ids], request):
            if token >= 0 and (piece := detok.push(token)):
                yield piece
        if tail := detok.flush():
            yield tail

    def generate(self, prompts: list[str], request: GenerationRequest | None = None, **template) -> list[str]:
        """Complete several prompts as one batch; returns one text per prompt."""
        request = request or GenerationRequest()
        batch = [self.prompt_ids(p, **template) for p in prompts]
        outputs: list[list[int]] = [[] for _ in prompts]
        for row_tokens in self.stream_ids(batch, request):
            for row, token in enumerate(row_tokens):
                if token >= 0:
                    outputs[row].append(token)
        return [self.tokenizer.decode(ids, skip_special_tokens=True) for ids in outputs]
