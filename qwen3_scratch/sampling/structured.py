"""Structured output: a grammar decides, token by token, which tokens keep the output valid.

A request's `StructuredOutputsParams` (vLLM's names: a JSON schema, a JSON object, a regex, a choice
of strings, or a Lark grammar) becomes a grammar; each sequence gets its own `Matcher` over it. Before
every draw the matcher gives a bitmask of the allowed tokens and `apply_bitmask` sets the others to
-inf; after it, the matcher advances by the token drawn. So the output is valid by construction, on any
weights: a random model can only pick among valid continuations, and EOS is allowed only where the
grammar may end.

The engine is llguidance (Microsoft's, also a vLLM backend), chosen over xgrammar by measurement on this
CPU with Qwen3's vocabulary (scripts/bench/benchmark_grammar.py, docs/performance.md): both cost 60-100 us
per token per sequence, at 1 and at 16 concurrent sequences, about 0.1% of a 0.6B decode step here; but
xgrammar compiles each new JSON schema ahead of time (0.93 s on 2 cores, on the engine's thread: every
request with a new schema would stall every other request), where llguidance builds its lexer lazily
(1.2 ms). JSON is compact (no free whitespace): a small or random model can otherwise fill its whole
budget with spaces, the failure vLLM's `disable-any-whitespace` exists for.

Shapes: B rows, V vocab, W = ceil(V / 32) words of the bitmask.
"""

import json
from dataclasses import dataclass

import torch

from qwen3_scratch.errors import GenerationError, printable

from .after_reasoning import GrammarAfterReasoning

MAX_SPEC_BYTES = 256 * 1024  # a schema or grammar's size: bounded compile work whatever the request


@dataclass
class StructuredOutputsParams:
    """Exactly one of these constrains the output (vLLM's StructuredOutputsParams)."""

    json: dict | str | None = None  # a JSON schema (dict or its text): the output is one instance of it
    regex: str | None = None  # the whole output matches this regular expression
    choice: list[str] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # a Lark grammar in llguidance's dialect (`start:` rule; %json{...} embeds a schema)
    json_object: bool | None = None  # any JSON object (OpenAI's response_format json_object)
    # Where the grammar starts (after_reasoning.py): after this tag, one token of the tokenizer (Qwen3's
    # "</think>"), the tokens before it free; None: from the first token. vLLM's reasoning_end_str.
    reasoning_end_str: str | None = None
    thinking_token_budget: int | None = None  # then the tag is forced after this many free tokens (vLLM's name)

    def kinds(self) -> list[str]:
        kinds = ("json", "regex", "choice", "grammar", "json_object")
        return [k for k in kinds if getattr(self, k) not in (None, False)]


def check_structured_outputs(value, label: str = "structured_outputs") -> None:
    if not isinstance(value, StructuredOutputsParams):
        raise GenerationError(f"{label} must be a StructuredOutputsParams, got {printable(repr(value), 80)}")
    if len(value.kinds()) != 1:
        raise GenerationError(f"{label} must set exactly one of json, regex, choice, grammar, json_object; "
                              f"got {value.kinds() or 'none'}")  # fmt: skip
    if value.choice is not None and not (
        isinstance(value.choice, list) and value.choice and all(isinstance(c, str) and c for c in value.choice)
    ):
        raise GenerationError(f"{label}.choice must be a non-empty list of non-empty strings")
    for kind in ("regex", "grammar"):
        if getattr(value, kind) is not None and not isinstance(getattr(value, kind), str):
            raise GenerationError(f"{label}.{kind} must be a string")
    if value.json is not None and not isinstance(value.json, (dict, str)):
        raise GenerationError(f"{label}.json must be a JSON schema (an object or its text)")
    if value.reasoning_end_str is not None and not isinstance(value.reasoning_end_str, str):
        raise GenerationError(f"{label}.reasoning_end_str must be a string (a tag such as '</think>')")
    budget = value.thinking_token_budget
    if budget is not None and (value.reasoning_end_str is None or type(budget) is not int or budget < 0):
        raise GenerationError(f"{label}.thinking_token_budget must be an integer >= 0, with reasoning_end_str")
    if len(to_lark_or_schema_text(value)) > MAX_SPEC_BYTES:
        raise GenerationError(f"{label} is larger than {MAX_SPEC_BYTES // 1024} KiB; send a smaller schema or grammar")


def to_lark_or_schema_text(spec: StructuredOutputsParams) -> str:
    if spec.json is not None:
        return spec.json if isinstance(spec.json, str) else json.dumps(spec.json)
    if spec.choice is not None:
        return json.dumps(spec.choice)
    return spec.regex or spec.grammar or "{}"


def lark_string(text: str) -> str:
    """A Lark string literal for text (JSON's escapes are Lark's)."""
    return json.dumps(text)


class GrammarCompiler:
    """Grammars for one tokenizer: built once per engine (llguidance reads the whole vocabulary, ~1 s for Qwen3's).

    tokenizer_json: the checkpoint's tokenizer.json text; vocab_size: the model's rows (the mask's width);
    eos_ids: the ids that may end a constrained output once the grammar is complete."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: list[int]):
        try:
            import llguidance
        except ImportError as error:  # an optional dependency: say how to get it
            raise GenerationError('structured output needs llguidance: pip install -e ".[serve]"') from error
        self.ll = llguidance
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_ids))
        self.vocab_size = vocab_size
        # the tags a grammar may start after (reasoning_end_str) are whole tokens: "</think>" -> 151668
        self.added = {t["content"]: t["id"] for t in json.loads(tokenizer_json).get("added_tokens", [])}

    def grammar(self, spec: StructuredOutputsParams, label: str = "structured_outputs") -> str:
        """The llguidance grammar for spec; GenerationError naming label if it is not a valid one."""
        Matcher = self.ll.LLMatcher
        try:
            if spec.json is not None or spec.json_object:
                schema = spec.json if spec.json is not None else {"type": "object"}
                grammar = Matcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
            elif spec.regex is not None:
                grammar = Matcher.grammar_from_regex(spec.regex)
            elif spec.choice is not None:
                grammar = Matcher.grammar_from_lark("start: " + " | ".join(lark_string(c) for c in spec.choice))
            else:
                grammar = Matcher.grammar_from_lark(spec.grammar)
        except (ValueError, TypeError) as error:
            raise GenerationError(f"{label} is not a valid {spec.kinds()[0]}: {printable(str(error), 300)}") from None
        problem = Matcher.validate_grammar(grammar, self.tokenizer)
        if problem and not problem.startswith("WARNING"):
            raise GenerationError(f"{label} is not a valid {spec.kinds()[0]}: {printable(problem, 300)}")
        if spec.reasoning_end_str is not None and spec.reasoning_end_str not in self.added:
            raise GenerationError(f"{label}.reasoning_end_str {printable(repr(spec.reasoning_end_str), 40)} is not "
                                  "one token of this tokenizer; send a tag such as '</think>'")  # fmt: skip
        return grammar

    def matcher(self, grammar: str, spec: StructuredOutputsParams | None = None):
        """A sequence's Matcher over grammar; after spec's reasoning_end_str, if it has one (after_reasoning.py)."""
        matcher = Matcher(self.ll.LLMatcher(self.tokenizer, grammar, log_level=0), self.vocab_size)
        if spec is None or spec.reasoning_end_str is None:
            return matcher
        return GrammarAfterReasoning(matcher, self.added[spec.reasoning_end_str], spec.thinking_token_budget)


class Matcher:
    """One sequence's place in its grammar."""

    def __init__(self, matcher, vocab_size: int):
        self.matcher, self.vocab_size = matcher, vocab_size

    def bitmask(self) -> torch.Tensor:
        """(W,) int32: bit i % 32 of word i // 32 set where token i is allowed next."""
        import llguidance.torch as llt

        mask = llt.allocate_token_bitmask(1, self.vocab_size)  # (1, W)
        llt.fill_next_token_bitmask(self.matcher, mask, 0)
        return mask[0]

    def accept(self, token_id: int) -> None:
        if not self.matcher.consume_token(token_id):  # cannot happen for a token drawn under the mask
            raise GenerationError(f"the grammar refused token {token_id}: {printable(self.matcher.get_error(), 200)}")


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits (B, V), bitmask (B, W) int32 -> logits with every token whose bit is 0 set to -inf."""
    B, V = logits.shape
    bits = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = ((bitmask.to(logits.device)[:, :, None] >> bits) & 1).bool()  # (B, W, 32)
    allowed = allowed.reshape(B, -1)[:, :V]  # (B, V)
    return logits.masked_fill(~allowed, float("-inf"))
