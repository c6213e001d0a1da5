"""Generated token ids -> an assistant message: reasoning, answer and tool calls kept apart.

Qwen3 writes its answer as

    <think>\\nREASONING\\n</think>\\n\\nANSWER\\n<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call><|im_end|>

where every tag is one token of its own (`<think>` 151667, `</think>` 151668, `<tool_call>` 151657,
`</tool_call>` 151658), so the parser reads tags by id, never by searching decoded text. That makes it
exact (a user's text that merely *spells* "</think>" is text) and lets it run one token at a time.

The result has the shape OpenAI-style clients and chat templates use:

    {"role": "assistant", "content": "ANSWER", "reasoning_content": "REASONING",
     "tool_calls": [{"id": "call_…", "type": "function", "function": {"name": ..., "arguments": "<json>"}}]}

`reasoning_content` is None when the model did not reason; `tool_calls` is there only when it called.
A `<tool_call>` block whose JSON does not parse into {"name": str, "arguments": object} stays in the
content as the text it was, and its problem is listed under "tool_call_errors": never an exception.
The prompt may already have opened `<think>` (templates that start every answer thinking), in which
case the output starts as reasoning: `prompt_opens_thinking` tells, from the prompt's ids.

Both users of this module, the chat API and the server, stream: `StreamParser.push` takes one token
and returns typed `Delta`s (reasoning text, answer text, a finished tool call); `parse_assistant` is
the same parser run over a whole list. Text deltas never end in half a UTF-8 character.
"""

import json
import uuid
from dataclasses import dataclass
from typing import Literal

from .tokenizer import StreamingDetokenizer, Tokenizer

THINK, END_THINK = "<think>", "</think>"
TOOL_CALL, END_TOOL_CALL = "<tool_call>", "</tool_call>"


@dataclass
class Delta:
    """One piece of a streamed answer."""

    kind: Literal["reasoning", "content", "tool_call"]
    text: str = ""  # reasoning or answer text ("" for a tool call)
    tool_call: dict | None = None  # {"id", "type": "function", "function": {"name", "arguments"}}


def prompt_opens_thinking(prompt_ids: list[int], tokenizer: Tokenizer) -> bool:
    """True when the prompt ends inside an open <think>, so the model's output starts as reasoning."""
    think, end_think = tokenizer.token_to_id(THINK), tokenizer.token_to_id(END_THINK)
    last_open = max((i for i, t in enumerate(prompt_ids) if t == think), default=-1)
    last_close = max((i for i, t in enumerate(prompt_ids) if t == end_think), default=-1)
    return last_open > last_close


def parse_assistant(ids, tokenizer: Tokenizer, *, in_reasoning: bool = False) -> dict:
    """The assistant message for a whole list of generated ids (see the module docstring)."""
    parser = StreamParser(tokenizer, in_reasoning=in_reasoning)
    for token_id in ids:
        parser.push(token_id)
    parser.finish()
    return parser.message()


class _Section:
    """The text of one part of the answer (reasoning, or the answer), streamed without edge newlines.

    Qwen3 puts newlines around its tags ("<think>\\n…\\n</think>\\n\\n"); they belong to the format,
    not to the text. Leading newlines are dropped, and trailing ones are held back until more text
    follows, so the streamed pieces add up to exactly the final message's text.
    """

    def __init__(self, tokenizer: Tokenizer):
        self.detok = StreamingDetokenizer(tokenizer, skip_special_tokens=True)
        self.text = ""  # what has been emitted
        self.held = ""  # trailing newlines not yet emitted

    def push(self, token_id: int) -> str:
        return self._emit(self.detok.push(token_id))

    def append(self, text: str) -> str:
        """Add text that did not come token by token (a tool-call block that failed to parse)."""
        return self._emit(text)

    def close(self) -> str:
        """The rest of the text, once the section ends (trailing newlines are dropped)."""
        return self._emit(self.detok.flush(), final=True)

    def _emit(self, piece: str, final: bool = False) -> str:
        piece = self.held + piece
        if not self.text:
            piece = piece.lstrip("\n")
        body = piece.rstrip("\n")
        self.held = "" if final else piece[len(body) :]
        self.text += body
        return body


class StreamParser:
    """Push generated ids one at a time; get `Delta`s back; `message()` is the answer so far."""

    def __init__(self, tokenizer: Tokenizer, *, in_reasoning: bool = False):
        self.tokenizer = tokenizer
        self.ids = {tag: tokenizer.token_to_id(tag) for tag in (THINK, END_THINK, TOOL_CALL, END_TOOL_CALL)}
        self.special = set(tokenizer.special_tokens.values())  # <|im_end|> and friends are not text
        self.reasoning: _Section | None = _Section(tokenizer) if in_reasoning else None
        self.content = _Section(tokenizer)
        self.state = "reasoning" if in_reasoning else "content"
        self.call_ids: list[int] | None = None  # the ids inside an open <tool_call>
        self.tool_calls: list[dict] = []
        self.tool_call_errors: list[str] = []
        self.reasoning_tokens = 0  # tokens spent thinking, the tags included

    def push(self, token_id: int) -> list[Delta]:
        token_id = int(token_id)
        if self.state == "reasoning":
            self.reasoning_tokens += 1
            if token_id == self.ids[END_THINK]:
                self.state = "content"
                return self._deltas("reasoning", self.reasoning.close())
            if token_id == self.ids[THINK] and self.reasoning_tokens == 1:
                return []  # the model opens the reasoning it was started in: the tag is format, not text
            return [] if token_id in self.special else self._deltas("reasoning", self.reasoning.push(token_id))
        if self.state == "tool_call":
            if token_id == self.ids[END_TOOL_CALL]:
                return self._end_tool_call(closed=True)
            self.call_ids.append(token_id)
            return []
        # the answer
        if token_id == self.ids[THINK] and self.reasoning is None and not self.content.text:
            self.state, self.reasoning = "reasoning", _Section(self.tokenizer)  # the model opened it itself
            self.reasoning_tokens += 1
            return []
        if token_id == self.ids[TOOL_CALL]:
            self.state, self.call_ids = "tool_call", []
            return self._deltas("content", self.content.close())  # the newline before the tag is format
        if token_id in self.special:
            return []
        return self._deltas("content", self.content.push(token_id))

    def finish(self) -> list[Delta]:
        """End of the stream: flush what is held back; an unclosed <tool_call> becomes content."""
        deltas = []
        if self.state == "reasoning":
            deltas += self._deltas("reasoning", self.reasoning.close())
        if self.state == "tool_call":
            deltas += self._end_tool_call(closed=False)
        self.state = "done"
        return deltas + self._deltas("content", self.content.close())

    def message(self) -> dict:
        """The assistant message from what has been parsed so far (complete after `finish`)."""
        message = {
            "role": "assistant",
            "content": self.content.text,
            "reasoning_content": None if self.reasoning is None else self.reasoning.text,
        }
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        if self.tool_call_errors:
            message["tool_call_errors"] = self.tool_call_errors
        return message

    def _end_tool_call(self, closed: bool) -> list[Delta]:
        text = self.tokenizer.decode(self.call_ids, skip_special_tokens=True)
        self.state, self.call_ids = "content", None
        call, problem = _tool_call(text) if closed else (None, "the stream ended inside <tool_call>")
        if call is not None:
            self.tool_calls.append(call)
            return [Delta("tool_call", tool_call=call)]
        # Not a call after all: the block goes back into the answer as the text it was.
        self.tool_call_errors.append(problem)
        block = f"{TOOL_CALL}{text}{END_TOOL_CALL if closed else ''}"
        separator = "\n" if self.content.text else ""
        return self._deltas("content", self.content.append(separator + block))

    @staticmethod
    def _deltas(kind: str, text: str) -> list[Delta]:
        return [Delta(kind, text)] if text else []


def _tool_call(text: str) -> tuple[dict | None, str]:
    """The call written between <tool_call> tags, or None and what is wrong with it."""
    try:
        data = json.loads(text)
    except ValueError as error:
        return None, f"tool call is not valid JSON ({error})"
    if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not data["name"]:
        return None, 'tool call needs {"name": "...", "arguments": {...}}'
    arguments = data.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None, "tool call arguments are not a JSON object"
    if not isinstance(arguments, dict):
        return None, "tool call arguments are not a JSON object"
    function = {"name": data["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": function}, ""
