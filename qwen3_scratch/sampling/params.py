"""`SamplingParams`: what one request asks for — how to sample, how long to go on, when to stop.

One class, in vLLM's names, for every way in: `Pipeline` and `LLM` take it, the CLIs build it from
their flags, the server from a request's JSON. So a value is checked by one set of rules
(`FIELD_CHECKS`, the table of limits below) wherever it comes from, and a message names the flag or
field it came in by.

    SamplingParams(temperature=0.7, top_p=0.9, max_tokens=64, stop=["\\n\\n"], seed=0)

A sampling field left None means "the checkpoint's default": `with_defaults(generation_config)` fills
it from the checkpoint's generation_config.json (Qwen3 ships temperature 0.6, top-k 20, top-p 0.95),
else from vLLM's defaults (temperature 1, no top-k/top-p/min-p). `Pipeline`, `LLM` and the server all
fill them that way, so one request means the same thing on every path. (vLLM's own `SamplingParams()`
means temperature 1 whatever the checkpoint says; here you get the checkpoint's.)

How a row of logits becomes a token is `logits.py`; `logits_filter` is the part of these settings it
needs.
"""

import functools
import math
from dataclasses import dataclass, field, fields, replace

from .logits import (
    LogitsFilter,
    check_min_p,
    check_temperature,
    check_top_k,
    check_top_p,
    is_int,
    is_number,
    require,
)
from .logprobs import MAX_LOGPROBS
from .processors import LogitsProcessing
from .structured import StructuredOutputsParams, check_structured_outputs

MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed takes an unsigned 64-bit seed
MAX_TOKEN_ID = 2**31 - 1  # ids are int32 anywhere a tokenizer or a kernel meets them
FILTER_FIELDS = ("temperature", "top_k", "top_p", "min_p")
MAX_N = 128  # choices per request (OpenAI's limit)
MAX_LOGIT_BIAS = 1024  # entries in logit_bias or bad_words: bounded work per step whatever the request


def check_seed(value, label: str = "seed") -> None:
    require(is_int(value) and 0 <= value <= MAX_SEED, label, "an integer from 0 to 2**64 - 1", value)


def check_max_tokens(value, label: str = "max_tokens") -> None:
    require(is_int(value) and value >= 1, label, "an integer >= 1", value)


def check_stop(value, label: str = "stop") -> None:
    ok = isinstance(value, list) and all(isinstance(s, str) and s for s in value)
    require(ok, label, "a non-empty string or a list of them", value)


def check_stop_token_ids(value, label: str = "stop_token_ids") -> None:
    ok = isinstance(value, list) and all(is_int(i) and 0 <= i <= MAX_TOKEN_ID for i in value)
    require(ok, label, f"a list of token ids (integers from 0 to {MAX_TOKEN_ID})", value)


def check_flag(value, label: str) -> None:
    require(isinstance(value, bool), label, "true or false", value)


def check_n(value, label: str = "n") -> None:
    require(is_int(value) and 1 <= value <= MAX_N, label, f"an integer from 1 to {MAX_N}", value)


def check_openai_penalty(value, label: str) -> None:
    # written as `-2 <= x <= 2` so that NaN fails too
    require(is_number(value) and -2 <= value <= 2, label, "a number from -2 to 2", value)


def check_repetition_penalty(value, label: str = "repetition_penalty") -> None:
    ok = is_number(value) and math.isfinite(value) and value > 0
    require(ok, label, "a finite number > 0 (1 is off)", value)


def check_logit_bias(value, label: str = "logit_bias") -> None:
    ok = isinstance(value, dict) and len(value) <= MAX_LOGIT_BIAS and all(
        is_int(k) and 0 <= k <= MAX_TOKEN_ID and is_number(b) and -100 <= b <= 100 for k, b in value.items()
    )
    require(ok, label, f"a map of at most {MAX_LOGIT_BIAS} token ids to biases from -100 to 100", value)


def check_count(value, label: str) -> None:
    require(is_int(value) and value >= 0, label, "an integer >= 0", value)


def check_bad_words(value, label: str = "bad_words") -> None:
    ok = isinstance(value, list) and len(value) <= MAX_LOGIT_BIAS
    ok = ok and all(isinstance(w, str) and w.strip() for w in value)
    require(ok, label, f"a list of at most {MAX_LOGIT_BIAS} non-blank strings", value)


def check_logprobs(value, label: str = "logprobs") -> None:
    require(is_int(value) and 0 <= value <= MAX_LOGPROBS, label, f"an integer from 0 to {MAX_LOGPROBS}", value)


# The table of limits: field -> its check (value, label). None values are never checked: they mean
# "the default". A new field gets a line here, and a test fails for a field without one.
FIELD_CHECKS = {
    "temperature": check_temperature,
    "top_p": check_top_p,
    "top_k": check_top_k,
    "min_p": check_min_p,
    "seed": check_seed,
    "max_tokens": check_max_tokens,
    "stop": check_stop,
    "stop_token_ids": check_stop_token_ids,
    "ignore_eos": check_flag,
    "skip_special_tokens": check_flag,
    "n": check_n,
    "presence_penalty": check_openai_penalty,
    "frequency_penalty": check_openai_penalty,
    "repetition_penalty": check_repetition_penalty,
    "logit_bias": check_logit_bias,
    "min_tokens": check_count,
    "bad_words": check_bad_words,
    "logprobs": check_logprobs,
    "prompt_logprobs": check_logprobs,
    "structured_outputs": check_structured_outputs,
}


def check_fields(values: dict, labels: dict[str, str] | None = None) -> None:
    """Raise GenerationError for the first value its rule refuses, naming it by labels[field] (a CLI
    flag, say) or by the field's own name."""
    for name, value in values.items():
        if value is not None:
            FIELD_CHECKS[name](value, (labels or {}).get(name, name))


@dataclass
class SamplingParams:
    temperature: float | None = None  # divides the logits; 0 is greedy. None: the checkpoint's, else 1
    top_p: float | None = None  # nucleus: keep the top tokens holding this probability. None: checkpoint's, else 1 (off)
    top_k: int | None = None  # keep the k likeliest tokens; 0 (or vLLM's -1) is off. None: checkpoint's, else 0
    min_p: float | None = None  # drop tokens under min_p x the top token's probability. None: checkpoint's, else 0
    seed: int | None = None  # a seeded request draws from its own generator: the same tokens in any batch
    max_tokens: int | None = 16  # new tokens at most (vLLM's default 16); None: as many as the context holds
    stop: list[str] | str | None = None  # stop strings: the text ends before the first one found
    stop_token_ids: list[int] = field(default_factory=list)  # ids that end the request, like EOS
    ignore_eos: bool = False  # go on past EOS (benchmarks); stop_token_ids still stop
    skip_special_tokens: bool = True  # drop <|im_end|> and friends from the text
    n: int = 1  # independent completions of the one prompt (they share its cached blocks in the engine)
    # logit processing, in vLLM's names and order (processors.py)
    presence_penalty: float = 0.0  # OpenAI's: minus this once for every token already in the output
    frequency_penalty: float = 0.0  # OpenAI's: minus this times the token's count in the output
    repetition_penalty: float = 1.0  # vLLM's/CTRL's: tokens of the prompt or output divided (or times) by it
    logit_bias: dict[int, float] | None = None  # OpenAI's: token id -> added to its logit, -100 to 100
    min_tokens: int = 0  # EOS and stop_token_ids banned, stop strings ignored, until this many tokens were generated
    bad_words: list[str] = field(default_factory=list)  # never generated (their token sequences are banned)
    logprobs: int | None = None  # logprob of each sampled token and of its top-k alternatives (0: itself only)
    prompt_logprobs: int | None = None  # the same for every prompt token (the first has none)
    structured_outputs: StructuredOutputsParams | None = None  # JSON schema, regex, choice or grammar

    def __post_init__(self):
        if self.top_k == -1:
            self.top_k = 0  # vLLM spells "off" as -1
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [] if self.stop is None else self.stop
        self.stop_token_ids = [] if self.stop_token_ids is None else self.stop_token_ids
        self.bad_words = [] if self.bad_words is None else self.bad_words
        if isinstance(self.logit_bias, dict):  # JSON object keys arrive as strings: "100" means id 100
            self.logit_bias = token_id_keys(self.logit_bias)
        check_fields({f.name: getattr(self, f.name) for f in fields(self)})
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            require(False, "min_tokens", f"at most max_tokens ({self.max_tokens})", self.min_tokens)
        self.stop, self.stop_token_ids = list(self.stop), list(self.stop_token_ids)
        self.bad_words = list(self.bad_words)

    def with_defaults(self, generation_config: dict) -> "SamplingParams":
        """A copy whose unset sampling fields are the checkpoint's (generation_config.json, as
        `sampling.defaults.load_generation_config` reads it), else vLLM's defaults.

        `do_sample: false` in the checkpoint makes greedy the default (temperature 0), as transformers
        does; a temperature given here still wins. A missing do_sample does not imply greedy."""
        chosen = {key: generation_config[key] for key in FILTER_FIELDS if key in generation_config}
        if generation_config.get("do_sample") is False:
            chosen["temperature"] = 0.0
        defaults = LogitsFilter()
        for key in FILTER_FIELDS:
            chosen.setdefault(key, getattr(defaults, key))
        return replace(self, **{key: value for key, value in chosen.items() if getattr(self, key) is None})

    @property
    def logits_filter(self) -> LogitsFilter:
        """The filter `logits.sample` applies; unset fields count as vLLM's defaults here (call
        `with_defaults` first for the checkpoint's)."""
        return filter_of(*(getattr(self, key) for key in FILTER_FIELDS))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def processing(self, bad_words_ids: tuple[tuple[int, ...], ...] = ()) -> LogitsProcessing:
        """The logit processing these settings ask for (processors.py); bad words as the caller tokenized them."""
        return LogitsProcessing(
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, logit_bias=tuple(sorted((self.logit_bias or {}).items())),
            min_tokens=self.min_tokens, bad_words=bad_words_ids,
        )  # fmt: skip


def token_id_keys(bias: dict) -> dict:
    """logit_bias with token-id keys: JSON sends "100" for id 100; other keys are left for the check to refuse."""
    return {int(k) if isinstance(k, str) and k.isdigit() and len(k) <= 12 else k: v for k, v in bias.items()}


@functools.lru_cache(maxsize=256, typed=True)  # typed: True, 1 and 1.0 are checked apart
def filter_of(*values) -> LogitsFilter:
    """The LogitsFilter of FILTER_FIELDS' values (None: the default), made and checked once per distinct set:
    the engine asks for every sampled row's filter every step (64 rows: ~1 ms a step of constructing and
    checking the same few filters again)."""
    return LogitsFilter(**{key: value for key, value in zip(FILTER_FIELDS, values) if value is not None})
