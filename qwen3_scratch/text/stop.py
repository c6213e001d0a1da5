"""Stop strings: generated text, arriving in pieces, cut before the first stop string.

The engine, `LLM.chat`, the server and `Pipeline` all stop a generation this way (a request's
`SamplingParams.stop`), and the text ends *before* the stop string, as in OpenAI's API and vLLM:
  - `StopText`: text arriving in pieces, cut before the first stop string;
  - `TextState`: a sequence's token ids -> its text, streamed (never half a character), stop applied;
  - `AnswerStop`: a chat reply's typed pieces, the answer cut (reasoning and tool calls pass as they are).

min_tokens (`SamplingParams.min_tokens`) holds stop strings back as vLLM v1 does: a stop string counts
only if its last character comes from generated token min_tokens + 1 or later. One that starts in the
first min_tokens tokens' text and ends after them counts, and the text is cut before its start as usual
(so the text may end inside those first tokens' text); one that lies wholly in that text is ignored.
"""

from .chat_parser import Delta, StreamParser
from .tokenizer import StreamingDetokenizer, Tokenizer


class StopText:
    """Text that arrives in pieces, cut before the first stop string.

    A stop string can span pieces, so the last len(longest stop) - 1 characters are held back until
    the next piece shows whether a stop string starts there; `take` releases only what is final.
    `checked_from`: a stop string counts only if it ends at or after this index (min_tokens moves it).
    """

    def __init__(self, stop: list[str]):
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text, self.emitted, self.checked_from = "", 0, 0

    def push(self, piece: str, check: bool = True) -> bool:
        """Add a piece; True if a stop string appeared (the text is then cut before it).
        check=False: the piece is text no stop string may end in (the first min_tokens tokens')."""
        old = len(self.text)
        self.text += piece
        if not check:
            self.checked_from = len(self.text)
            return False
        # each stop string is looked for only where it would end in new, checked text
        ends_from = max(old, self.checked_from)
        hits = [i for i in (self.text.find(s, max(ends_from - len(s) + 1, 0)) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
        return bool(hits)

    def take(self, finished: bool) -> str:
        """The text made final since the last take: all of it once finished."""
        end = len(self.text) if finished else max(len(self.text) - self.hold, self.emitted)
        piece, self.emitted = self.text[self.emitted : end], end
        return piece


class TextState:
    """A sequence's text so far, decoded token by token, with its stop strings applied
    (none ending in the first min_tokens tokens' text: see the module docstring)."""

    def __init__(self, tokenizer: Tokenizer, stop: list[str], skip_special_tokens: bool = True, min_tokens: int = 0):
        self.detok = StreamingDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
        self.stop = StopText(stop)
        self.min_tokens, self.generated = min_tokens, 0

    def push(self, token_id: int) -> bool:
        """Add a token's text; True if a stop string appeared."""
        self.generated += 1
        return self.stop.push(self.detok.push(token_id), check=self.generated > self.min_tokens)

    def take(self, finished: bool, stopped: bool) -> str:
        """The text made final since the last take (see StopText.take)."""
        if finished and not stopped:  # a last incomplete character, as decode() would show it
            self.stop.push(self.detok.flush(), check=self.generated > self.min_tokens)
        return self.stop.take(finished)


class AnswerStop:
    """A chat reply's tokens, through a StreamParser, as Deltas with the answer cut before the first
    stop string (none ending in the first min_tokens tokens' answer text: see the module docstring).

    Answer text is held back while a stop string may be forming; reasoning and tool calls pass."""

    def __init__(self, stop: list[str], min_tokens: int = 0):
        self.answer = StopText(stop)
        self.min_tokens, self.generated = min_tokens, 0

    def push(self, parser: StreamParser, token_id: int) -> list[Delta]:
        """One generated token: the deltas to show now."""
        self.generated += 1
        check = self.generated > self.min_tokens
        shown = self._pieces(parser.push(token_id), check)
        if not check:  # trailing newlines the parser holds back (until text follows) came from these tokens too
            self.answer.checked_from += len(parser.content.held)
        return shown

    def finish(self, parser: StreamParser) -> list[Delta]:
        """The end of the reply: the parser's last deltas and the answer's held-back tail."""
        shown = self._pieces(parser.finish(), check=self.generated > self.min_tokens)
        if tail := self.answer.take(finished=True):
            shown.append(Delta("content", tail))
        return shown

    @property
    def text(self) -> str:
        """The whole answer so far, cut (held-back tail included)."""
        return self.answer.text

    def _pieces(self, deltas: list[Delta], check: bool) -> list[Delta]:
        shown = []
        for delta in deltas:
            if delta.kind == "content":
                self.answer.push(delta.text, check)
                delta = Delta("content", self.answer.take(finished=False))
            if delta.text or delta.tool_call:
                shown.append(delta)
        return shown

    @classmethod
    def reply(cls, tokenizer: Tokenizer, ids, in_reasoning: bool, stop: list[str], min_tokens: int = 0) -> dict:
        """The assistant message for a whole list of generated ids, its answer cut as a stream cuts it."""
        parser, whole = StreamParser(tokenizer, in_reasoning=in_reasoning), cls(stop, min_tokens)
        for token_id in ids:
            whole.push(parser, token_id)
        whole.finish(parser)
        return {**parser.message(), "content": whole.text}
