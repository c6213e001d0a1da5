"""vLLM's `speculative_config`, read and checked before anything loads.

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    {"model": "Qwen/Qwen3-0.6B", "num_speculative_tokens": 4}        # "method": "draft_model" inferred

"ngram" is prompt lookup (speculative.py); "draft_model" a smaller Qwen3 with the target's tokenizer
(draft_proposer.py). Every refusal is one line naming the field and what to write instead.
"""

import json
from dataclasses import dataclass, fields

from qwen3_scratch.errors import GenerationError

MAX_SPECULATIVE_TOKENS = 15
METHODS = ("ngram", "draft_model")
NGRAM_ONLY = ("prompt_lookup_max", "prompt_lookup_min")
EXAMPLE = """write e.g. '{"method": "ngram", "num_speculative_tokens": 4}' or '{"model": "Qwen/Qwen3-0.6B"}'"""


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 3  # ngram: the longest suffix looked up
    prompt_lookup_min: int = 1  # ngram: the shortest suffix that may match
    model: str | None = None  # draft_model: the draft's folder or Hub id

    @classmethod
    def parse(cls, value) -> "SpeculativeConfig | None":
        """From a dict or a JSON string (None: no speculation); a bad value raises a one-line error naming the field."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as error:
                raise GenerationError(f"speculative_config is not valid JSON ({error.msg}): {EXAMPLE}") from None
        if not isinstance(value, dict):
            raise GenerationError(f"speculative_config must be a JSON object: {EXAMPLE}")
        known = {f.name for f in fields(cls)}
        for name in value:
            if name not in known:
                raise GenerationError(f"speculative_config.{name} is not a known field; "
                                      f"use {', '.join(sorted(known))}")  # fmt: skip
        value = {"method": "draft_model" if value.get("model") is not None else "ngram", **value}
        check_method(value)
        config = cls(**value)
        check_numbers(config)
        return config


def check_method(value: dict) -> None:
    """The method is known, and the fields given belong to it."""
    method = value["method"]
    if method not in METHODS:
        raise GenerationError(f"speculative_config.method must be \"ngram\" (prompt lookup) or \"draft_model\" "
                              f"(with \"model\"), got {method!r}")  # fmt: skip
    if method == "draft_model":
        model = value.get("model")
        if not isinstance(model, str) or not model.strip():
            raise GenerationError("speculative_config.model must name the draft model (a folder or Hub id) for "
                                  f"method \"draft_model\", got {model!r}")  # fmt: skip
        for name in NGRAM_ONLY:
            if name in value:
                raise GenerationError(f"speculative_config.{name} is for method \"ngram\" only; drop it with a "
                                      "\"model\"")  # fmt: skip
    elif value.get("model") is not None:
        raise GenerationError("speculative_config.model is for method \"draft_model\"; drop \"method\": \"ngram\" "
                              "or the model")  # fmt: skip


def check_numbers(config: SpeculativeConfig) -> None:
    limits = {"num_speculative_tokens": MAX_SPECULATIVE_TOKENS, "prompt_lookup_max": 64, "prompt_lookup_min": 64}
    for name, most in limits.items():
        got = getattr(config, name)
        if not isinstance(got, int) or isinstance(got, bool) or not 1 <= got <= most:
            raise GenerationError(f"speculative_config.{name} must be an integer from 1 to {most}, got {got!r}")
    if config.prompt_lookup_min > config.prompt_lookup_max:
        raise GenerationError("speculative_config.prompt_lookup_min must be <= prompt_lookup_max, got "
                              f"{config.prompt_lookup_min} > {config.prompt_lookup_max}")  # fmt: skip
