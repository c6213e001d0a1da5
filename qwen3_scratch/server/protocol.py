"""OpenAI's HTTP API, as data: request bodies in, response and stream-chunk bodies out.

Field names are OpenAI's (and vLLM's extensions: top_k, min_p, ignore_eos, chat_template_kwargs),
so the `openai` client and tools built for vLLM work unchanged. The reasoning goes beside `content`
under both names clients read: `reasoning` (vLLM's current name) and `reasoning_content` (its older
one, and the one Qwen3's chat template reads back from history).
"""

import time
import uuid
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from qwen3_scratch.errors import GenerationError
from qwen3_scratch.sampling.params import FILTER_FIELDS, SamplingParams

from .messages import ChatMessage, Tool


class SamplingFields(BaseModel):
    # OpenAI fields we do not implement (user, logit_bias...) pass. Strict: `true` is not the token id 1,
    # nor "5" a seed; numbers are still numbers whether written 1 or 1.0 (for float fields)
    model_config = ConfigDict(extra="ignore", strict=True)

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

    def params(self, defaults: SamplingParams, max_tokens: int | None) -> SamplingParams:
        """This request's SamplingParams: its own values, else the checkpoint's defaults."""
        if self.n != 1:
            raise GenerationError(f"n must be 1 (one choice per request), got {self.n}")
        given = SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                               max_tokens=max_tokens, stop=self.stop, seed=self.seed,
                               stop_token_ids=self.stop_token_ids or [], ignore_eos=self.ignore_eos)  # fmt: skip
        return given.with_defaults({name: getattr(defaults, name) for name in FILTER_FIELDS})

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
    max_completion_tokens: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # {"enable_thinking": false}, as vLLM takes it

    @property
    def enable_thinking(self) -> bool:
        return bool((self.chat_template_kwargs or {}).get("enable_thinking", True))

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
    prompt: Annotated[str, Field(min_length=1)] | Annotated[list[int], Field(min_length=1)]


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


def chat_response(request_id: str, model: str, message: dict, finish_reason: str, usage_body: dict) -> dict:
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish_reason, "logprobs": None}],
        "usage": usage_body,
    }


def chat_chunk(request_id: str, model: str, delta: dict | None, finish_reason=None, usage_body=None) -> dict:
    """One SSE chunk; delta None makes the usage-only chunk OpenAI sends last (empty choices)."""
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}]
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


def completion_body(request_id, model, text, finish_reason, usage_body=None, chunk=False) -> dict:
    body = {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}],
    }
    if usage_body is not None or not chunk:
        body["usage"] = usage_body
    return body


def error_body(message: str, type_: str, code: str | int | None) -> dict:
    return {"error": {"message": message, "type": type_, "code": code, "param": None}}
