"""What one request asks of the engine: how to sample, how long to go on, when to stop.

Two classes, two jobs, on purpose:
  - `sampling.SamplingParams` is a logits filter (temperature, top-k, top-p, min-p): how to turn one
    row of logits into one token. The simple loops and the engine both apply it.
  - `RequestParams` (this module) is a whole request in vLLM's shape: the filter's fields plus
    max_tokens, stop strings, stop token ids and a seed. `qwen3_scratch.llm` exports it under vLLM's
    name, `SamplingParams`, so `from qwen3_scratch.llm import LLM, SamplingParams` reads like vLLM;
    inside the package it keeps its own name so the two are never confused.
"""

from dataclasses import dataclass, field

from .errors import GenerationError
from .sampling import SamplingParams as LogitsFilter
from .sampling import check_min_p, check_temperature, check_top_k, check_top_p


@dataclass
class RequestParams:
    temperature: float = 1.0  # 0 is greedy
    top_p: float = 1.0  # 1 = off
    top_k: int = 0  # 0 (or vLLM's -1) = off
    min_p: float = 0.0  # 0 = off
    max_tokens: int | None = 16  # new tokens at most (vLLM's default 16); None: up to the context
    stop: list[str] | str | None = None  # stop strings: the text ends before the first one found
    stop_token_ids: list[int] = field(default_factory=list)  # extra ids that end the request, like EOS
    seed: int | None = None  # a seeded request draws from its own generator: reproducible in any batch
    ignore_eos: bool = False  # keep going past EOS (benchmarks)
    skip_special_tokens: bool = True  # drop <|im_end|> and friends from the text

    def __post_init__(self):
        if self.top_k == -1:
            self.top_k = 0  # vLLM spells "off" as -1
        check_temperature(self.temperature, "temperature")
        check_top_k(self.top_k, "top_k")
        check_top_p(self.top_p, "top_p")
        check_min_p(self.min_p, "min_p")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise GenerationError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise GenerationError(f"seed must be an integer, got {self.seed!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if not all(isinstance(s, str) and s for s in self.stop):
            raise GenerationError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        if not all(_is_int(i) for i in self.stop_token_ids):
            raise GenerationError(f"stop_token_ids must be integers, got {self.stop_token_ids!r}")

    @property
    def logits_filter(self) -> LogitsFilter:
        return LogitsFilter(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
