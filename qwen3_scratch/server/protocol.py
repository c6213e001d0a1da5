"""OpenAI's HTTP API, as data: request bodies in, response and stream-chunk bodies out.

Field names are OpenAI's (and vLLM's extensions: top_k, min_p, repetition_penalty, min_tokens, bad_words,
ignore_eos, stop_token_ids, prompt_logprobs, structured_outputs, chat_template_kwargs), so the `openai`
client and tools built for vLLM work unchanged. Which OpenAI fields do what is fields.py's table: any
field it refuses, or does not know, is a 400 naming it, never ignored. The reasoning goes beside `content`
under both names clients read: `reasoning` (vLLM's current name) and `reasoning_content` (its older
one, and the one Qwen3's chat template reads back from history).
"""

import time
import uuid
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from qwen3_scratch.errors import GenerationError
from qwen3_scratch.sampling.params import FIELD_CHECKS, FILTER_FIELDS, SamplingParams, token_id_keys
from qwen3_scratch.sampling.structured import StructuredOutputsParams

from .fields import RefusedField, check_request_fields
from .messages import ChatMessage, Tool


class SamplingFields(BaseModel):
    # Unknown fields are kept (not ignored) so that fields.check_request_fields can refuse them by name.
    # Strict: `true` is not the token id 1, nor "5" a seed; numbers are still numbers whether written 1 or
    # 1.0 (for float fields).
    model_config = ConfigDict(extra="allow", strict=True)

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    ignore_eos: bool = False
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_tokens: int | None = None
    bad_words: list[str] | None = None
    skip_special_tokens: bool | None = None
    prompt_logprobs: int | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def check_fields(self, route: str) -> None:
        """Refuse (400, naming it) a field this server does not implement, or does not know."""
        check_request_fields(self.model_dump(exclude_unset=True), route)

    def params(self, defaults: SamplingParams, max_tokens: int | None, logprobs: int | None = None,
               prompt_logprobs: int | None = None,
               structured: StructuredOutputsParams | None = None) -> SamplingParams:  # fmt: skip
        """This request's SamplingParams: its own values, else the checkpoint's defaults. A value out of its
        limits is refused naming the request's field (the table of limits is sampling/params.py's)."""
        values = dict(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p, seed=self.seed,
            max_tokens=max_tokens, stop=[self.stop] if isinstance(self.stop, str) else self.stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, n=self.n,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, min_tokens=self.min_tokens, bad_words=self.bad_words,
            logit_bias=None if self.logit_bias is None else token_id_keys(self.logit_bias),
            skip_special_tokens=self.skip_special_tokens, logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
            structured_outputs=structured,
        )  # fmt: skip
        values = {name: value for name, value in values.items() if value is not None}
        for name, value in values.items():
            label = self.field_name(name)
            try:
                FIELD_CHECKS[name](value, label)
            except GenerationError as error:
                raise RefusedField(label, str(error)) from None
        given = SamplingParams(**values)
        return given.with_defaults({name: getattr(defaults, name) for name in FILTER_FIELDS})

    def field_name(self, name: str) -> str:
        """The request field a SamplingParams field came from (they differ only where OpenAI's names do)."""
        return {"structured_outputs": "response_format"}.get(name, name)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))

    @field_validator("stream_options")
    @classmethod
    def _usage_flag_is_bool(cls, value):
        return check_flags(value, ("include_usage", "continuous_usage_stats"))


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]  # roles and shapes checked (messages.py)
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_completion_tokens: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # {"enable_thinking": false}, as vLLM takes it
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    reasoning_effort: str | None = None  # Qwen3's switch: "none"/"minimal" is thinking off, any other level on

    @property
    def enable_thinking(self) -> bool:
        if self.reasoning_effort is not None:
            return self.reasoning_effort not in ("none", "minimal")
        return bool((self.chat_template_kwargs or {}).get("enable_thinking", True))

    def field_name(self, name: str) -> str:
        return {"logprobs": "top_logprobs", "max_tokens": "max_completion_tokens" if self.max_completion_tokens
                is not None else "max_tokens"}.get(name, super().field_name(name))  # fmt: skip

    def logprobs_k(self) -> int | None:
        """SamplingParams.logprobs for this request: None unless logprobs is true (top_logprobs alone is an error)."""
        if self.top_logprobs is not None and not self.logprobs:
            raise RefusedField("top_logprobs", "top_logprobs needs logprobs: true")
        return (self.top_logprobs or 0) if self.logprobs else None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _thinking_flag_is_bool(cls, value):
        return check_flags(value, ("enable_thinking",))

    def chat_messages(self) -> list[dict]:
        """Messages for the template: content given as a list of text parts becomes one string."""
        return [message.as_dict() for message in self.messages]

    def template_tools(self) -> list[dict] | None:
        """The tools for the template, as plain dicts; None when there are none or tool_choice is "none"."""
        return [tool.as_dict() for tool in self.tools] if self.tools and self.tool_choice != "none" else None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompts: one text or token-id list, or a list of them (each gets n choices)."""
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return [self.prompt]
        if not self.prompt:
            raise RefusedField("prompt", "prompt is empty: send a string, a list of strings or of token ids")
        return list(self.prompt)


def check_flags(options: dict | None, names: tuple[str, ...]) -> dict | None:
    """options unchanged, or ValueError (HTTP 422) if one of `names` in it is not true or false."""
    for name in names:
        if options is not None and not isinstance(options.get(name, False), bool):
            raise ValueError(f"{name} must be true or false")
    return options


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int, cached: int = 0, reasoning: int | None = None) -> dict:
    body = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    if reasoning is not None:
        body["completion_tokens_details"] = {"reasoning_tokens": reasoning}
    return body


def assistant_message(parsed: dict) -> dict:
    """chat_parser's message -> OpenAI's: reasoning under both names, tool calls only if any."""
    message = {"role": "assistant", "content": parsed["content"] if parsed["content"] or not parsed.get("tool_calls")
               else None}  # fmt: skip
    message["reasoning_content"] = message["reasoning"] = parsed.get("reasoning_content")
    if parsed.get("tool_calls"):
        message["tool_calls"] = parsed["tool_calls"]
    return message


def chat_finish_reason(reason: str | None, parsed_or_calls) -> str | None:
    return "tool_calls" if reason == "stop" and parsed_or_calls else reason


def chat_choice(index: int, message: dict, finish_reason: str, logprobs: dict | None = None) -> dict:
    return {"index": index, "message": message, "finish_reason": finish_reason, "logprobs": logprobs}


def chat_response(request_id: str, model: str, choices: list[dict], usage_body: dict) -> dict:
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage_body,
    }


def chat_chunk(request_id: str, model: str, delta: dict | None, finish_reason=None, usage_body=None, index: int = 0,
               logprobs: dict | None = None) -> dict:  # fmt: skip
    """One SSE chunk; delta None makes the usage-only chunk OpenAI sends last (empty choices)."""
    choices = [] if delta is None else [{"index": index, "delta": delta, "finish_reason": finish_reason,
                                         "logprobs": logprobs}]  # fmt: skip
    chunk = {"id": request_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
             "choices": choices}  # fmt: skip
    if usage_body is not None:
        chunk["usage"] = usage_body
    return chunk


def delta_body(delta, tool_index: int) -> dict:
    """chat_parser.Delta -> an OpenAI stream delta."""
    if delta.kind == "reasoning":
        return {"reasoning_content": delta.text, "reasoning": delta.text}
    if delta.kind == "content":
        return {"content": delta.text}
    return {"tool_calls": [{"index": tool_index, **delta.tool_call}]}


def completion_choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None = None) -> dict:
    return {"index": index, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}


def completion_body(request_id, model, choices: list[dict], usage_body=None, chunk=False) -> dict:
    body = {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
    }
    if usage_body is not None or not chunk:
        body["usage"] = usage_body
    return body


def error_body(message: str, type_: str, code: str | int | None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "code": code, "param": param}}
