"""The shapes of a chat request's messages and tools, as OpenAI defines them, checked when it is parsed.

A message the chat template cannot place is refused here (HTTP 422, naming the message and the
field) instead of being dropped or mangled by the template: a role other than system, user,
assistant and tool (the template would write "<|im_start|>wizard", a turn Qwen3 never saw), content
that is neither text nor a list of text parts, a tool call without a function name. Unknown extra
keys pass (clients send `name`, `tool_call_id` and others the template ignores).

`as_dict()` gives the template what it reads: plain dicts, a list of text parts joined into one
string, unset fields left out.
"""

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, model_validator


class Shape(BaseModel):
    model_config = ConfigDict(extra="allow")

    def as_dict(self) -> dict:
        return self.model_dump(exclude_none=True)


class TextPart(Shape):
    type: Literal["text"]
    text: str


class FunctionCall(Shape):
    name: str
    arguments: str | dict[str, Any] = "{}"  # OpenAI sends a JSON string; a dict is written as JSON


class ToolCall(Shape):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Shape):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = None
    reasoning_content: str | None = None  # an assistant turn's reasoning, as vLLM returns it
    reasoning: str | None = None

    @model_validator(mode="after")
    def _placeable(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content (only an assistant's may be null, with tool_calls)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"only assistant messages carry tool_calls, not {self.role} ones")
        return self

    def as_dict(self) -> dict:
        message = super().as_dict()
        if isinstance(self.content, list):
            message["content"] = "".join(part.text for part in self.content)
        return message


class FunctionDefinition(Shape):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema


class Tool(Shape):
    type: Literal["function"]
    function: FunctionDefinition
