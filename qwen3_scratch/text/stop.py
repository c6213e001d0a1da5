"""Stop strings: generated text, arriving in pieces, cut before the first stop string.

The engine, `LLM.chat`, the server and `Pipeline` all stop a generation this way (a request's
`SamplingParams.stop`), and the text ends *before* the stop string, as in OpenAI's API and vLLM:
  - `StopText`: text arriving in pieces, cut before the first stop string;
  - `TextState`: a sequence's token ids -> its text, streamed (never half a character), stop applied;
  - `AnswerStop`: a chat reply's typed pieces, the answer cut (reasoning and tool calls pass as they are).
"""

from .chat_parser import Delta
from .tokenizer import StreamingDetokenizer, Tokenizer


class StopText:
    """Text that arrives in pieces, cut before the first stop string.

    A stop string can span pieces, so the last len(longest stop) - 1 characters are held back until
    the next piece shows whether a stop string starts there; `take` releases only what is final.
    """

    def __init__(self, stop: list[str]):
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text, self.emitted = "", 0

    def push(self, piece: str) -> bool:
        """Add a piece; True if a stop string appeared (the text is then cut before it)."""
        searched_from = max(len(self.text) - self.hold, 0)
        self.text += piece
        hits = [i for i in (self.text.find(s, searched_from) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
        return bool(hits)

    def take(self, finished: bool) -> str:
        """The text made final since the last take: all of it once finished."""
        end = len(self.text) if finished else max(len(self.text) - self.hold, self.emitted)
        piece, self.emitted = self.text[self.emitted : end], end
        return piece


class TextState:
    """A sequence's text so far, decoded token by token, with its stop strings applied."""

    def __init__(self, tokenizer: Tokenizer, stop: list[str], skip_special_tokens: bool = True):
        self.detok = StreamingDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
        self.stop = StopText(stop)

    def push(self, token_id: int) -> bool:
        """Add a token's text; True if a stop string appeared."""
        return self.stop.push(self.detok.push(token_id))

    def take(self, finished: bool, stopped: bool) -> str:
        """The text made final since the last take (see StopText.take)."""
        if finished and not stopped:
            self.stop.push(self.detok.flush())  # a last incomplete character, as decode() would show it
        return self.stop.take(finished)


class AnswerStop:
    """A chat reply's pieces (chat_parser.Delta) with the answer cut before the first stop string.

    Answer text is held back while a stop string may be forming; reasoning and tool calls pass."""

    def __init__(self, stop: list[str]):
        self.answer = StopText(stop)

    def pieces(self, deltas: list[Delta], finished: bool = False) -> list[Delta]:
        """The deltas to show now; with finished, also the answer's held-back tail."""
        shown = []
        for delta in deltas:
            if delta.kind == "content":
                self.answer.push(delta.text)
                delta = Delta("content", self.answer.take(finished=False))
            if delta.text or delta.tool_call:
                shown.append(delta)
        if finished and (tail := self.answer.take(finished=True)):
            shown.append(Delta("content", tail))
        return shown

    @staticmethod
    def cut(text: str, stop: list[str]) -> str:
        """A whole answer, cut before the first stop string."""
        whole = StopText(stop)
        whole.push(text)
        return whole.take(finished=True)
