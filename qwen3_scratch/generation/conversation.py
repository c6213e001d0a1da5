"""Multi-turn chat: each turn renders the whole conversation, but prefills only what the cache lacks.

A conversation is a list of messages. Every turn, the chat template renders the whole list, the model
generates the assistant's reply, and the caller appends it and the next user message. Running the whole
history through the model every turn would cost O(history) per turn for nothing: a token's keys and
values depend only on the tokens before it, so whatever prefix the new prompt shares with the tokens
already in the cache is already computed.

The new prompt is not always the old sequence plus the new message. Qwen3's template drops the reasoning
of past turns, so the reply just generated (`<think>...</think>answer`) comes back shorter; a caller may
edit an earlier message. So the cache remembers the token id in each of its slots, and each turn keeps
the longest common prefix of those ids and the new prompt and prefills the rest, over the unchanged
model (explicit slots, positions and mask, as loops.py's `prefill` and `decode_step` use it).

Shapes: S cache slots, T tokens in one forward, V vocab.
"""

import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from qwen3_scratch.errors import GenerationError
from qwen3_scratch.model.kv_cache import KVCache, attended_slots, attention_mask
from qwen3_scratch.model.qwen3 import Qwen3
from qwen3_scratch.sampling.logits import NON_FINITE, LogitsFilter, all_finite, sample
from qwen3_scratch.sampling.params import SamplingParams
from qwen3_scratch.sampling.processors import LogitsProcessing, LoopProcessing
from qwen3_scratch.text.chat_parser import Delta, StreamParser, prompt_opens_thinking
from qwen3_scratch.text.stop import AnswerStop, TextState
from qwen3_scratch.text.tokenizer import Tokenizer

from .loops import CACHE_BLOCK, plan_new_tokens
from .stats import SpeculationStats


def common_prefix_length(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class ConversationCache:
    """A batch-1 KV cache that outlives a generation, knowing which token id fills each slot.

    Invariant: slots 0..len(tokens)-1 hold the keys/values of `tokens`, computed as one sequence;
    anything in later slots is stale and never attended (the mask stops at the current sequence).
    """

    def __init__(self, model: Qwen3, block: int = CACHE_BLOCK):
        self.model, self.block = model, block
        self.cache: KVCache | None = None
        self.tokens: list[int] = []

    def reset(self) -> None:
        self.tokens = []  # the tensors stay allocated for the next conversation

    def prefill(self, prompt_ids: list[int], reserve: int = 0) -> torch.Tensor:
        """Make the cache hold prompt_ids, running only the tokens past the common prefix.

        reserve: slots to keep free after the prompt (the tokens about to be generated).
        Returns the next-token logits, (1, V).
        """
        # The last prompt token runs even when it is cached: its logits give the first new token.
        keep = min(common_prefix_length(self.tokens, prompt_ids), len(prompt_ids) - 1)
        # Slots past the common prefix were computed after other tokens: forget them before anything
        # runs, so an interrupted prefill leaves the invariant true.
        self.tokens = self.tokens[:keep]
        self._reserve(len(prompt_ids) + reserve)
        logits = self._run(prompt_ids[keep:], keep)
        self.tokens = list(prompt_ids)
        return logits

    def step(self, token: int) -> torch.Tensor:
        """Append one token (the one just sampled); returns the logits after it, (1, V)."""
        logits = self._run([token], len(self.tokens))
        self.tokens.append(token)
        return logits

    def extend(self, ids: list[int]) -> torch.Tensor:
        """Append ids in one forward; returns the logits after each of them, (T, V): what checking
        proposed tokens needs (generation/speculative.py)."""
        self._reserve(len(self.tokens) + len(ids))
        logits = self._run(ids, len(self.tokens), last_only=False)[0]  # (T, V)
        self.tokens += ids
        return logits

    def truncate(self, length: int) -> None:
        """Keep the first `length` tokens. The slots after them (rejected proposals) are stale, which
        the invariant allows: the next forward overwrites them, and until then the causal mask, which
        stops at the newest token, never lets a query see them."""
        del self.tokens[length:]

    def _run(self, ids: list[int], start: int, last_only: bool = True) -> torch.Tensor:
        device = self.model.device
        # One row and no padding: a token's slot is its RoPE position.
        slots = torch.arange(start, start + len(ids), device=device)  # (T,)
        # Causal: stale slots past the newest token are never seen, even inside the attended blocks.
        S = attended_slots(start + len(ids), self.cache.max_len)
        mask = attention_mask(slots, self.cache.key_valid[:, :S])  # (1, 1, T, S)
        input_ids = torch.tensor([ids], device=device)  # (1, T)
        logits = self.model(input_ids, slots[None], mask, self.cache, slots, last_only=last_only)  # (1, T or 1, V)
        return logits[:, -1] if last_only else logits

    def _reserve(self, length: int) -> None:
        """Grow to at least `length` slots (whole blocks, at most the context), keeping the valid ones."""
        if self.cache is not None and self.cache.max_len >= length:
            return
        # RoPE tables too: on a GPU forward() does not grow them itself (that would sync every step).
        self.model.reserve_positions(length)
        context = self.model.config.max_position_embeddings
        size = min(-(-length // self.block) * self.block, context)
        bigger = KVCache(self.model.config, 1, size, self.model.device, self.model.activation_dtype)
        n = len(self.tokens)
        if self.cache is not None and n:
            bigger.copy_prefix(self.cache, n)  # (L, 1, K, n, D) of keys and of values
        self.cache = bigger


def count_reasoning_tokens(tokenizer: Tokenizer, prompt_ids: list[int], ids: list[int]) -> int:
    """How many of the generated `ids` are reasoning (the prompt may have opened <think> already)."""
    parser = StreamParser(tokenizer, in_reasoning=prompt_opens_thinking(prompt_ids, tokenizer))
    for token in ids:
        parser.push(token)
    parser.finish()
    return parser.reasoning_tokens


@dataclass
class TurnStats:
    prompt_tokens: int
    reused_tokens: int  # prompt tokens whose keys/values came from the previous turn's cache
    generated_tokens: int
    reasoning_tokens: int
    ttft_seconds: float
    elapsed_seconds: float
    speculation: SpeculationStats | None = None  # a speculative turn's counts (stats.py)

    def line(self) -> str:
        pairs = {key: value for key, value in vars(self).items() if key != "speculation"}
        if self.speculation is not None:
            pairs |= self.speculation.pairs(self.generated_tokens)
        return " ".join(f"{key}={value:.3f}" if isinstance(value, float) else f"{key}={value}"
                        for key, value in pairs.items())  # fmt: skip


class Conversation:
    """Chat turns over one model and one ConversationCache.

    Stateless about the messages (the caller owns the list and may edit it); stateful only about the
    cache, which any message list can reuse as far as its tokens agree with the cached ones.
    """

    def __init__(self, model: Qwen3, tokenizer: Tokenizer, eos_ids: list[int], generation_config: dict,
                 reuse: bool = True, speculator=None):  # fmt: skip
        self.model, self.tokenizer = model, tokenizer
        self.eos_ids, self.generation_config = set(eos_ids), generation_config
        self.reuse = reuse  # False: every turn prefills its whole prompt, as a single-prompt API does
        self.speculator = speculator  # a speculative.Speculator: turns speculate over this cache
        self.cache = ConversationCache(model)
        self.last_message: dict | None = None
        self.last_prompt: list[int] = []
        self.last_ids: list[int] = []  # the generated ids of the last turn, EOS included
        self.last_stats: TurnStats | None = None

    def stream(self, messages: list[dict], params: SamplingParams, tools=None, thinking: bool = True,
               processing: LogitsProcessing | None = None, should_stop=None) -> Iterator[Delta]:  # fmt: skip
        """Yield the reply to `messages` as typed pieces; `last_message` holds it once the stream ends.

        params: its unset fields take the checkpoint's defaults. The reply ends at EOS, a stop token,
        max_tokens or the context end; at a stop string the answer ends before it. Closing the stream
        early (Ctrl-C) still leaves what was generated so far in `last_message`. processing: the
        request's penalties, bias, min_tokens and bad words (sampling/processors.py). should_stop: asked after
        every token; True ends the stream there as closing it would. A reader stops between pieces, and a
        stretch of tokens may show none (a tool call's arguments are held until it closes): this is how a
        Ctrl-C during one still stops the answer at once.
        """
        params = params.with_defaults(self.generation_config)
        context = self.model.config.max_position_embeddings
        prompt = self.tokenizer.chat_ids(messages, enable_thinking=thinking, tools=tools)
        n_new = plan_new_tokens(len(prompt), params.max_tokens or context, context)
        generator = None
        if params.seed is not None:
            generator = torch.Generator(self.model.device).manual_seed(params.seed)
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_ids)
        # ends the turn at a stop string
        text = TextState(self.tokenizer, params.stop, params.skip_special_tokens, params.min_tokens)
        shown = AnswerStop(params.stop, params.min_tokens)
        parser = StreamParser(self.tokenizer, in_reasoning=prompt_opens_thinking(prompt, self.tokenizer))
        if not self.reuse:
            self.cache.reset()
        reused = min(common_prefix_length(self.cache.tokens, prompt), len(prompt) - 1)
        self.last_prompt, self.last_ids, self.last_message, self.last_stats = prompt, [], None, None
        start, ttft, finished = time.perf_counter(), None, False
        process = None
        if processing is not None and processing.active:
            process = LoopProcessing(processing, torch.tensor([prompt], device=self.model.device),
                                     self.model.config.vocab_size, sorted(stop_ids))  # fmt: skip
        if self.speculator is not None and process is None:
            tokens = self.speculator.generate(self.cache, prompt, n_new, params.logits_filter, generator, stop_ids)
        else:  # penalties, bias and the like read every earlier token: such a turn decodes one token a step
            tokens = self.plain_tokens(prompt, n_new, params.logits_filter, generator, process)
        try:
            for i, token in enumerate(tokens):
                if token == NON_FINITE:
                    raise GenerationError(f"stopped at generated token {i + 1}: the model's logits are NaN or inf; "
                                          "try --dtype float32, or download the checkpoint again")  # fmt: skip
                ttft = ttft if ttft is not None else time.perf_counter() - start
                self.last_ids.append(token)
                stopped = text.push(token)
                yield from shown.push(parser, token)
                if stopped or token in stop_ids:
                    break
                if should_stop is not None and should_stop():
                    return  # as if closed: the tokens so far are the reply (finally, below)
            finished = True
            yield from shown.finish(parser)
        finally:
            if not finished:
                shown.finish(parser)  # interrupted: the tokens so far still make a message
            self.last_message = {**parser.message(), "content": shown.text}  # the answer cut as it was shown
            elapsed = time.perf_counter() - start
            speculation = self.speculator.stats if self.speculator is not None else None
            self.last_stats = TurnStats(len(prompt), reused, len(self.last_ids), parser.reasoning_tokens,
                                        ttft if ttft is not None else elapsed, elapsed, speculation)  # fmt: skip

    def plain_tokens(self, prompt: list[int], n_new: int, params: LogitsFilter, generator,
                     process: LoopProcessing | None = None) -> Iterator[int]:  # fmt: skip
        """Plain decoding over the cache: one forward, one token (the consumer stops at EOS or a stop string)."""
        logits = self.cache.prefill(prompt, reserve=n_new)  # (1, V)
        for i in range(n_new):
            finite = None
            if process is not None:  # the model's logits are checked before processing bans tokens with -inf
                finite, logits = all_finite(logits), process(logits)
            token = int(sample(logits, params, generator, finite))  # the host sync streaming needs anyway
            if process is not None:
                process.push(torch.tensor([token], device=logits.device))
            yield token
            if i + 1 < n_new:
                logits = self.cache.step(token)
