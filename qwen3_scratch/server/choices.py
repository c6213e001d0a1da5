"""The choices of one response, built step by step from the engine's outputs: whole or as stream deltas.

A request's n choices (and, on /v1/completions, each prompt's n choices) come back from the engine
interleaved, told apart by `StepOutput.index`; each choice here keeps its own text, parser, stop-string
holder and logprobs. `merge` runs several engine requests (one per prompt) as one stream of outputs.
"""

import asyncio

from qwen3_scratch.sampling.params import SamplingParams
from qwen3_scratch.text.chat_parser import StreamParser, prompt_opens_thinking
from qwen3_scratch.text.stop import AnswerStop
from qwen3_scratch.text.tokenizer import Tokenizer

from . import protocol as api
from .logprobs import chat_logprobs, completion_logprobs, vllm_prompt_logprobs


class ChatChoice:
    def __init__(self, index: int, tokenizer: Tokenizer, prompt_ids: list[int], params: SamplingParams, logprobs: bool):
        self.index, self.tokenizer, self.logprobs = index, tokenizer, logprobs
        # a grammar that starts after </think> makes everything before it reasoning (sampling/after_reasoning.py)
        spec = params.structured_outputs
        after_reasoning = spec is not None and spec.reasoning_end_str is not None
        in_reasoning = after_reasoning or prompt_opens_thinking(prompt_ids, tokenizer)
        self.parser = StreamParser(tokenizer, in_reasoning=in_reasoning)
        self.shown = AnswerStop(params.stop, params.min_tokens)  # the answer as its stop strings cut it
        self.calls, self.out, self.scored = 0, None, []

    def push(self, out) -> list[dict]:
        """Take one step's output; returns the stream deltas it makes final (with this step's logprobs on the first)."""
        self.out = out
        # the answer is held back while a stop string may be forming
        deltas = [d for token in out.new_token_ids for d in self.shown.push(self.parser, token)]
        if out.finished:
            deltas += self.shown.finish(self.parser)
        bodies = []
        for delta in deltas:
            bodies.append(api.delta_body(delta, self.calls))
            self.calls += delta.kind == "tool_call"
        self.scored += out.logprobs or []
        if self.logprobs and out.logprobs and not bodies:
            bodies.append({})  # tokens that made no text yet still report their logprobs
        return bodies

    def step_logprobs(self, out) -> dict | None:
        return chat_logprobs(self.tokenizer, out.logprobs) if self.logprobs else None

    @property
    def finish_reason(self) -> str:
        return api.chat_finish_reason(self.out.finish_reason, self.calls or self.parser.message().get("tool_calls"))

    def whole(self) -> dict:
        parsed = {**self.parser.message(), "content": self.shown.text}  # the answer ends before a stop string
        logprobs = chat_logprobs(self.tokenizer, self.scored) if self.logprobs else None
        return api.chat_choice(self.index, api.assistant_message(parsed), self.finish_reason, logprobs)


class CompletionChoice:
    """One completion choice; with echo its text starts with the prompt (and its logprobs with the prompt's)."""

    def __init__(self, index: int, tokenizer: Tokenizer, prompt_ids: list[int], echo: bool, logprobs: bool):
        self.index, self.tokenizer, self.prompt_ids = index, tokenizer, prompt_ids
        self.echo, self.logprobs = echo, logprobs
        self.text, self.token_ids, self.scored, self.out = "", [], [], None
        self.streamed = False  # a stream chunk of this choice was sent (the first carries prompt_logprobs)

    def prompt_scores(self, seq) -> list | None:
        """vLLM's `prompt_logprobs` extension, when the request asked for it (the prompt is scored whole by
        the time its first token comes)."""
        if seq.params.prompt_logprobs is None:
            return None
        return vllm_prompt_logprobs(self.tokenizer, seq.sampling.prompt_logprobs)

    def prompt_part(self, seq) -> tuple[str, dict | None]:
        """The echoed prompt's text and logprobs (from the engine's prompt scores when asked for)."""
        text = self.tokenizer.decode(self.prompt_ids)
        if not self.logprobs:
            return text, None
        scored = seq.sampling.prompt_logprobs or [None] * len(self.prompt_ids)
        return text, completion_logprobs(self.tokenizer, self.prompt_ids, scored)

    def push(self, out, offset: int) -> dict | None:
        """Take one step's output; returns its logprobs body (text offsets from `offset`) when asked for."""
        self.out = out
        self.text += out.new_text
        self.token_ids += out.new_token_ids
        self.scored += out.logprobs or []
        if self.logprobs and out.logprobs:
            return completion_logprobs(self.tokenizer, out.new_token_ids, out.logprobs, offset)
        return None

    def whole(self, keep_generated: bool = True) -> dict:
        text, logprobs = "", None
        if self.echo:
            text, logprobs = self.prompt_part(self.out.seq)
        if keep_generated:
            if self.logprobs:
                generated = completion_logprobs(self.tokenizer, self.token_ids, self.scored, len(text))
                logprobs = generated if logprobs is None else {k: logprobs[k] + generated[k] for k in logprobs}
            text += self.text
        reason = self.out.finish_reason if keep_generated else "length"
        body = api.completion_choice(self.index, text, reason, logprobs)
        if (scores := self.prompt_scores(self.out.seq)) is not None:  # vLLM's extension, beside OpenAI's fields
            body["prompt_logprobs"] = scores
        return body

    def chunk_body(self, seq, text: str, reason: str | None = None, logprobs: dict | None = None) -> dict:
        """One stream chunk's choice; the first one carries prompt_logprobs, as vLLM sends them."""
        body = api.completion_choice(self.index, text, reason, logprobs)
        if not self.streamed and (scores := self.prompt_scores(seq)) is not None:
            body["prompt_logprobs"] = scores
        self.streamed = True
        return body


async def merge(streams):
    """Interleave several async iterators of step outputs: yields (which stream, output) as they come.
    Leaving early cancels every pump, which closes (and so aborts) each engine request."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(k, stream):
        try:
            async for out in stream:
                await queue.put((k, out))
        except Exception as error:  # noqa: BLE001 - handed to the consumer, which raises it
            await queue.put((k, error))
        finally:
            await queue.put((k, done))

    tasks = [asyncio.create_task(pump(k, s)) for k, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            k, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield k, item
    finally:
        for task in tasks:
            task.cancel()
