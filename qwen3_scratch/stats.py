"""Honest numbers about a generation: time to first token, decode speed, memory, bandwidth use.

Decode is memory-bound: every new token reads every weight (and the KV cache) once, so the fastest
possible decode is  bandwidth / bytes-read-per-step  steps per second. `bandwidth_util` is the share
of that limit a run reached.
"""

import resource
import time
from dataclasses import dataclass

import torch

from .config import Qwen3Config

_BANDWIDTH_CACHE: dict[str, float] = {}


@dataclass
class GenerationStats:
    prompt_tokens: int
    generated_tokens: int
    elapsed_seconds: float
    ttft_seconds: float
    decode_steps: int  # forward passes after the first token (each produces one token per row)
    batch_size: int
    device: str
    dtype: str
    peak_memory_bytes: int
    bytes_per_step: int  # weights + KV cache read by one decode step
    bandwidth_bytes_per_second: float | None = None  # measured; None if not asked for

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.elapsed_seconds if self.elapsed_seconds > 0 else 0.0

    @property
    def decode_seconds(self) -> float:
        return max(self.elapsed_seconds - self.ttft_seconds, 0.0)

    @property
    def decode_tokens_per_second(self) -> float:
        tokens = self.decode_steps * self.batch_size
        return tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0

    @property
    def bandwidth_util(self) -> float | None:
        if not self.bandwidth_bytes_per_second or self.decode_seconds <= 0:
            return None
        steps_per_second = self.decode_steps / self.decode_seconds
        return steps_per_second * self.bytes_per_step / self.bandwidth_bytes_per_second

    def line(self) -> str:
        """The stats line, as key=value pairs."""
        pairs = {
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "elapsed_seconds": f"{self.elapsed_seconds:.3f}",
            "tokens_per_second": f"{self.tokens_per_second:.2f}",
            "ttft_seconds": f"{self.ttft_seconds:.3f}",
            "decode_tokens_per_second": f"{self.decode_tokens_per_second:.2f}",
            "device": self.device,
            "dtype": self.dtype,
            "peak_memory_mb": f"{self.peak_memory_bytes / 2**20:.0f}",
            "bandwidth_util": "n/a" if self.bandwidth_util is None else f"{self.bandwidth_util:.3g}",
        }
        return " ".join(f"{k}={v}" for k, v in pairs.items())


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of all parameters (a tied matrix counted once, as it is read once per step, by lm_head)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def bytes_per_decode_step(model, config: Qwen3Config, context_len: int, batch_size: int) -> int:
    """What one decode step must read: every weight, plus the keys and values of the context.

    The embedding lookup reads one row, not the whole table; for untied models that table is
    not otherwise read, so it is left out.
    """
    weights = weight_bytes(model)
    # untied in the checkpoint, or given its own copy at load (prepacked or quantized lm_head)
    if model.lm_head.weight is not model.model.embed_tokens.weight:
        weights -= model.model.embed_tokens.weight.numel() * model.model.embed_tokens.weight.element_size()
    element = model.model.embed_tokens.weight.element_size()  # the cache is in the activations' dtype
    kv = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * context_len
    return weights + kv * batch_size * element


def measure_bandwidth(device: str | torch.device, nbytes: int = 256 * 2**20, repeats: int = 5) -> float:
    """Memory bandwidth in bytes/s, from the best of a few large copies (each reads and writes nbytes)."""
    key = str(device)
    if key in _BANDWIDTH_CACHE:
        return _BANDWIDTH_CACHE[key]
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        dst.copy_(src)
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    _BANDWIDTH_CACHE[key] = 2 * nbytes / best
    return _BANDWIDTH_CACHE[key]


def synchronize(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak_memory(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_bytes(device) -> int:
    """GPU: the most memory torch had allocated; CPU: the process's peak resident set size."""
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
