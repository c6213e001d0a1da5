"""Every request field OpenAI defines, and what this server does with it: nothing is dropped in silence.

Each field of OpenAI's chat and completions requests (the `openai` SDK's own lists, which
tests/test_openai_fields.py walks) is one of:
  - implemented: it does what OpenAI documents;
  - accepted: it exists only for OpenAI's own service (an end-user id for abuse monitoring, a routing
    key for OpenAI's prompt cache) and changes no output by its definition, so it is taken and has no effect;
  - refused: a request that sets it to anything but its neutral value gets 400 with `"param": field`
    and the reason.
The vLLM extensions the server takes are listed too; any other field is refused as unknown, so a typo
(`max_token`) is an error, not a default. README's server section is this table in prose.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Field:
    status: str  # "implemented", "accepted" or "refused"
    example: object  # a value a client sends: the field-walk test sends it
    reason: str = ""  # for accepted and refused fields: why
    neutral: tuple = (None,)  # values that ask for nothing: a refused field may carry them


def implemented(example) -> Field:
    return Field("implemented", example)


def accepted(example, reason: str) -> Field:
    return Field("accepted", example, reason)


def refused(example, reason: str, neutral: tuple = (None,)) -> Field:
    return Field("refused", example, reason, neutral)


NO_STORE = "this server stores no completions (nothing to attach metadata to or look up later)"
NOT_OURS = "an identifier for OpenAI's own abuse monitoring; nothing here reads it"
CACHE = "the prefix cache is automatic (chained block hashes), in memory, LRU: it needs no key or policy"

COMMON = {
    "model": implemented("tiny-qwen3"),
    "frequency_penalty": implemented(0.5),
    "presence_penalty": implemented(0.5),
    "logit_bias": implemented({"100": -100}),
    "max_tokens": implemented(4),
    "n": implemented(2),
    "seed": implemented(1),
    "stop": implemented(["\n\n"]),
    "stream": implemented(False),
    "stream_options": implemented({"include_usage": True}),
    "temperature": implemented(0.7),
    "top_p": implemented(0.9),
    "user": accepted("user-1", NOT_OURS),
}

CHAT = {
    **COMMON,
    "messages": implemented([{"role": "user", "content": "hi"}]),
    "max_completion_tokens": implemented(4),
    "logprobs": implemented(True),
    "top_logprobs": implemented(2),
    "response_format": implemented({"type": "json_object"}),
    "tools": implemented([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]),
    "tool_choice": implemented("auto"),
    "parallel_tool_calls": implemented(True),
    "reasoning_effort": implemented("none"),
    "modalities": refused(["text", "audio"], "text only: Qwen3 has no audio output", neutral=(None, ["text"])),
    "audio": refused({"voice": "alloy", "format": "wav"}, "text only: Qwen3 has no audio output"),
    "function_call": refused("auto", "OpenAI's deprecated form: send tools and tool_choice"),
    "functions": refused([{"name": "f", "parameters": {"type": "object"}}],
                         "OpenAI's deprecated form: send tools and tool_choice"),  # fmt: skip
    "prediction": refused({"type": "content", "content": "x"}, "predicted outputs are not implemented"),
    "web_search_options": refused({}, "this server has no web search"),
    "verbosity": refused("low", "Qwen3 has no verbosity control; say it in the prompt"),
    "moderation": refused({"model": "omni-moderation-latest"}, "this server runs no moderation model"),
    "store": refused(True, NO_STORE, neutral=(None, False)),
    "metadata": refused({"k": "v"}, NO_STORE, neutral=(None, {})),
    "service_tier": refused("priority", "one tier here", neutral=(None, "auto", "default")),
    "safety_identifier": accepted("user-1", NOT_OURS),
    "prompt_cache_key": accepted("key-1", CACHE),
    "prompt_cache_retention": accepted("in-memory", CACHE),
    "prompt_cache_options": accepted({}, CACHE),
}

COMPLETIONS = {
    **COMMON,
    "prompt": implemented("Hello"),
    "echo": implemented(True),
    "logprobs": implemented(2),
    "best_of": refused(2, "not implemented (vLLM dropped it too): ask for n and rank by logprobs",
                       neutral=(None, 1)),  # fmt: skip
    "suffix": refused("!", "fill-in-the-middle is not implemented", neutral=(None, "")),
}

# vLLM's extensions, taken on both routes (chat_template_kwargs on chat only)
VLLM = {
    "top_k": implemented(20),
    "min_p": implemented(0.05),
    "repetition_penalty": implemented(1.1),
    "min_tokens": implemented(1),
    "bad_words": implemented(["bad"]),
    "ignore_eos": implemented(False),
    "stop_token_ids": implemented([1]),
    "skip_special_tokens": implemented(True),
    "prompt_logprobs": implemented(1),
    "structured_outputs": implemented({"regex": "[ab]+"}),
    "guided_json": implemented({"type": "object"}),
    "guided_regex": implemented("[ab]+"),
    "guided_choice": implemented(["yes", "no"]),
    "guided_grammar": implemented('start: "yes" | "no"'),
}
CHAT_VLLM = {**VLLM, "chat_template_kwargs": implemented({"enable_thinking": False})}


class RefusedField(Exception):
    """A request field this server refuses: 400 with `param` naming it."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param, self.message = param, message


def check_request_fields(sent: dict, route: str) -> None:
    """Raise RefusedField for the first field of `sent` (what the client sent) that is refused or unknown."""
    table = {**CHAT, **CHAT_VLLM} if route == "chat" else {**COMPLETIONS, **VLLM}
    for name, value in sent.items():
        field = table.get(name)
        if field is None:
            raise RefusedField(name, f"unknown field {name!r}: this server implements OpenAI's {route} fields and "
                                     "vLLM's extensions (README, 'Serving'); remove it")  # fmt: skip
        if field.status == "refused" and value not in field.neutral:
            raise RefusedField(name, f"{name} is not supported: {field.reason}")
