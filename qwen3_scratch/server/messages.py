"""The shapes of a chat request's messages and tools, as OpenAI defines them, checked when it is parsed.

A message the chat template cannot place is refused here (HTTP 422, naming the message and the
field) instead of being dropped or mangled by the template: a role other than system, user,
assistant and tool (the template would write "<|im_start|>wizard", a turn Qwen3 never saw), content
that is neither text nor a list of text parts (only an assistant's may be left out, when it calls
tools), tool calls outside an assistant message, a tool call without a function name. Each role has
its own class, so the published schema (/openapi.json) says all this too. Unknown extra keys pass
(clients send `name` and others the template ignores).

`as_dict()` gives the template what it reads: plain dicts, a list of text parts joined into one
string, unset fields left out.
"""

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Shape(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # strict: 5 is not the text "5"

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


class Message(Shape):
    @model_validator(mode="after")
    def _tool_calls_only_from_the_assistant(self):
        if self.role != "assistant" and (self.model_extra or {}).get("tool_calls"):
            raise ValueError(f"only assistant messages carry tool_calls, not {self.role} ones")
        return self

    def as_dict(self) -> dict:
        message = super().as_dict()
        if isinstance(getattr(self, "content", None), list):
            message["content"] = "".join(part.text for part in self.content)
        return message


class SystemMessage(Message):
    role: Literal["system"]
    content: str | list[TextPart]


class UserMessage(Message):
    role: Literal["user"]
    content: str | list[TextPart]


class AssistantMessage(Message):
    role: Literal["assistant"]
    content: str | list[TextPart] | None = None  # None (or absent) only with tool_calls
    tool_calls: list[ToolCall] | None = None
    reasoning_content: str | None = None  # its reasoning, as vLLM returns it
    reasoning: str | None = None

    @model_validator(mode="after")
    def _says_something(self):
        if self.content is None and not self.tool_calls:
            raise ValueError("an assistant message needs content or tool_calls")
        return self


class ToolMessage(Message):
    role: Literal["tool"]
    content: str | list[TextPart]
    tool_call_id: str | None = None


# One of the four, told apart by `role`; any other role is refused by name.
ChatMessage = Annotated[SystemMessage | UserMessage | AssistantMessage | ToolMessage, Field(discriminator="role")]


class FunctionDefinition(Shape):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema


class Tool(Shape):
    type: Literal["function"]
    function: FunctionDefinition
