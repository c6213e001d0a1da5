"""Honest numbers about a generation: time to first token, decode speed, memory, bandwidth use.

Decode is memory-bound: every new token reads every weight it uses (all of a dense model; in a mixture
of experts, only the chosen experts) and the KV cache once, so the fastest
possible decode is  bandwidth / bytes-read-per-step  steps per second. `bandwidth_util` is the share
of that limit a run reached.

The stats line (`GenerationStats.line`), key by key, for one generation (one batch):
  prompt_tokens             prompt tokens of every row, padding not counted
  generated_tokens          tokens the rows produced, each row's EOS included, nothing after it
  elapsed_seconds           from the call to the last token (tokenizing excluded)
  tokens_per_second         generated_tokens / elapsed_seconds
  ttft_seconds              time to the first token: the prefill and the first sample
  decode_tokens_per_second  decode_tokens / (elapsed - ttft): tokens made after the first step by the
                            rows still running. A finished row keeps riding along in the batch (its
                            compute is spent) but makes no token, so it is not counted.
  device, dtype             where the model ran, in which dtype
  peak_memory_mb            CPU: the process's peak resident set size (ru_maxrss) since it started:
                            Python, torch, the weights' pages, everything; a high-water mark that never
                            falls, so a second run in one process reports at least the first's.
                            CUDA: the most memory torch's allocator handed out on the device during this
                            generation (weights, cache, activations; not its reserved-but-free cache).
  bandwidth_util            decode steps/s x bytes a step reads / measured bandwidth ("n/a" unless asked)
With speculative decoding (speculative.py), three more, and a decode step is one target forward:
  accepted_tokens           proposed tokens the target kept
  acceptance_rate           accepted_tokens / tokens proposed (each checked by the target)
  tokens_per_forward        tokens made after the first / target forwards after the prefill (plain decoding: 1)
"""

import resource
import time
from dataclasses import dataclass

import torch

from qwen3_scratch.model.config import Qwen3Config
from qwen3_scratch.model.moe import SparseMoeBlock

_BANDWIDTH_CACHE: dict[str, float] = {}


@dataclass
class SpeculationStats:
    """What speculative decoding did in one generation (see the module docstring)."""

    forwards: int = 0  # target forwards after the prefill; each checked a round's proposals
    proposed: int = 0  # tokens proposed, and checked by the target
    accepted: int = 0  # of those, the tokens the target kept

    def add_round(self, proposed: int, accepted: int) -> None:
        self.forwards += 1
        self.proposed += proposed
        self.accepted += accepted

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    def pairs(self, generated_tokens: int) -> dict[str, str]:
        """The stats line's keys for a generation of generated_tokens (its first came from the prefill)."""
        per_forward = (generated_tokens - 1) / self.forwards if self.forwards else 1.0
        return {"accepted_tokens": str(self.accepted), "acceptance_rate": f"{self.acceptance_rate:.3f}",
                "tokens_per_forward": f"{per_forward:.2f}"}  # fmt: skip


@dataclass
class GenerationStats:
    prompt_tokens: int
    generated_tokens: int
    elapsed_seconds: float
    ttft_seconds: float
    decode_steps: int  # forward passes after the first token (each produces one token per row)
    decode_tokens: int  # tokens those steps produced for rows that had not finished
    batch_size: int
    device: str
    dtype: str
    peak_memory_bytes: int
    bytes_per_step: int  # weights + KV cache read by one decode step
    bandwidth_bytes_per_second: float | None = None  # measured; None if not asked for
    speculation: SpeculationStats | None = None  # a speculative generation's counts; None for plain decoding

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.elapsed_seconds if self.elapsed_seconds > 0 else 0.0

    @property
    def decode_seconds(self) -> float:
        return max(self.elapsed_seconds - self.ttft_seconds, 0.0)

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens of unfinished rows per second after the first step (finished rows make none)."""
        return self.decode_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0

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
        if self.speculation is not None:
            pairs |= self.speculation.pairs(self.generated_tokens)
        return " ".join(f"{k}={v}" for k, v in pairs.items())


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of all parameters (a tied matrix counted once, as it is read once per step, by lm_head)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def bytes_per_decode_step(model, config: Qwen3Config, context_len: int, batch_size: int) -> int:
    """What one decode step must read: every weight it uses, plus the keys and values of the context.

    In a mixture of experts that is only the experts the step's tokens chose (unread_expert_bytes).

    The embedding lookup reads one row, not the whole table; for untied models that table is
    not otherwise read, so it is left out.
    """
    weights = weight_bytes(model) - unread_expert_bytes(model, batch_size)
    # untied in the checkpoint, or given its own copy at load (prepacked or quantized lm_head)
    if model.lm_head.weight is not model.model.embed_tokens.weight:
        weights -= model.model.embed_tokens.weight.numel() * model.model.embed_tokens.weight.element_size()
    element = model.model.embed_tokens.weight.element_size()  # the cache is in the activations' dtype
    kv = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * context_len
    return weights + kv * batch_size * element


def unread_expert_bytes(model, batch_size: int) -> int:
    """Bytes of the experts a decode step of batch_size tokens does not read, summed over MoE layers.

    One token reads k of E experts. B tokens choose independently, so they read E * (1 - (1 - k/E)^B)
    distinct experts on average if routing were uniform (exactly k for B = 1; all E as B grows).
    """
    unread = 0.0
    for block in model.modules():
        if isinstance(block, SparseMoeBlock):
            E, k = len(block.experts), block.top_k
            first = next(iter(block.experts.children()))  # a list, or (parallel/) a rank's dict of experts
            expert = sum(p.numel() * p.element_size() for p in first.parameters())
            unread += expert * (E - E * (1 - (1 - k / E) ** batch_size))
    return round(unread)


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
    """CUDA: the most memory torch's allocator had handed out since reset_peak_memory (this run);
    CPU: the process's peak resident set size since it started (Linux cannot reset it)."""
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
