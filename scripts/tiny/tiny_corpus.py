"""The tiny trained Qwen3's training documents, made offline from a seed, and packed into training rows.

Two kinds of documents, both token ids with a loss mask (which tokens the model is trained to write):
  - chat turns in Qwen3's exact format, rendered by the checkpoint's own chat template: an exercise
    (tiny_tasks.py) with its working in <think> or, with thinking off, the answer alone; a tool episode
    (the calculator declared in the system turn, a <tool_call>, a <tool_response> turn, the answer);
    a little small talk. Only the assistant's turn is trained (the prompt is context), so the model
    learns to answer, not to ask. Each assistant turn is one document whose prompt is exactly what the
    template writes at inference (`add_generation_prompt`, `enable_thinking`), so training and use agree;
  - plain text: docstrings and source of the Python standard library, on every machine, every token
    trained, ending in <|endoftext|>. Files whose name hashes into one in twenty are held out for perplexity.

Rows are packed from whole chat documents and text cut to fill the gaps, with each document's positions
starting at 0 and attention kept inside it (`Batch.mask`), so a document trains as if it were alone.

Shapes: B rows, T tokens per row.
"""

import functools
import random
import sysconfig
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from tiny_tasks import CALCULATOR, FAMILIES, calculate, exercise

SYSTEM_PROMPTS = ["You are a helpful assistant.", "You are a careful assistant. Show your working.",
                  "You are Qwen, a tiny model trained on a CPU."]  # fmt: skip
SMALL_TALK = [
    (["Hello!", "Hi!", "Hello! Who are you?", "Who are you?", "What are you?", "Hi, what can you do?"],
     "Hello! I am a tiny Qwen3 trained from scratch on a CPU in a few minutes. I can add and subtract, "
     "sort numbers and convert units, showing my working, and I call a calculator for big products."),
    (["Thank you!", "Thanks.", "Great, thanks!"], "You are welcome!"),
    (["What can you do?", "How can you help me?"],
     "I can add and subtract numbers, sort a list of numbers, convert units such as km to m, and use the "
     "calculator tool for long products and sums."),
]  # fmt: skip
# The chat mix, by draws (a tool draw makes two documents of ~260 tokens, most of it the template's tools
# preamble, untrained; an exercise makes one of ~100, two thirds trained). Most of it is column arithmetic:
# with Muon, copying (repeat, convert) and the calculator's call learn from a few percent of the draws, but the
# digit tables need the bulk (add and subtract at 0.25 / 0.2: held-out add 20%, subtract 7% with thinking on;
# this mix: add 93% / 83%, subtract 43% / 43% for seeds 0 / 1; docs/performance-history.md).
CHAT_MIX = {"repeat": 0.05, "add": 0.45, "subtract": 0.25, "sort": 0.02, "convert": 0.1, "tool": 0.06,
            "small_talk": 0.02}  # fmt: skip
TEXT_SHARE = 0.05  # of the tokens: plain text only has to make completions read like text
THINKING_OFF = 0.3  # exercises answered without reasoning (the template's empty <think></think>)


@dataclass
class Document:
    ids: list[int]
    trained: list[bool]  # per token: is it a target of the loss
    splittable: bool = False  # plain text may be cut across rows; a chat turn may not


def assistant_turn_document(tokenizer, messages, tools=None, thinking=True) -> Document:
    """The last message (the assistant's) as a document: the template's prompt before it, untrained."""
    prompt = tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=True, enable_thinking=thinking,
                                           tools=tools)  # fmt: skip
    full = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tools=tools)
    full = full.removesuffix("\n")  # the newline after <|im_end|> is never generated
    prompt_ids, ids = tokenizer.encode(prompt), tokenizer.encode(full)
    if not full.startswith(prompt) or ids[: len(prompt_ids)] != prompt_ids:
        raise AssertionError(f"the template's prompt is not a prefix of the conversation:\n{prompt!r}\n{full!r}")
    return Document(ids, [False] * len(prompt_ids) + [True] * (len(ids) - len(prompt_ids)))


def exercise_messages(rng: random.Random, family: str, held_out: bool = False):
    """(messages up to the user's question, the exercise, thinking, tools) for one exercise turn."""
    task = exercise(family, rng, held_out)
    thinking = rng.random() >= THINKING_OFF
    question = task.question
    if rng.random() < 0.5:  # Qwen3's soft switches, as the chat command appends them
        question += " /think" if thinking else " /no_think"
    messages = [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}] if rng.random() < 0.3 else []
    if rng.random() < 0.15:  # an earlier exchange: the template shows its answer, not its reasoning
        earlier = exercise(rng.choice(list(FAMILIES)), rng)
        messages += [{"role": "user", "content": earlier.question}, {"role": "assistant", "content": earlier.answer}]
    tools = [CALCULATOR] if rng.random() < 0.05 else None  # declared but not needed for small numbers
    return messages + [{"role": "user", "content": question}], task, thinking, tools


def reply(task, thinking: bool) -> dict:
    return {"role": "assistant", "content": task.answer, "reasoning_content": task.working if thinking else None}


def tool_episode(rng: random.Random, held_out: bool = False):
    """The messages of a calculator episode and its thinking switch: question, call, result, answer."""
    task = exercise("tool", rng, held_out)
    thinking = rng.random() >= 0.2
    expression = task.key.removeprefix("tool ")
    call = {"role": "assistant", "content": "", "reasoning_content": task.working if thinking else None,
            "tool_calls": [{"type": "function", "function": {"name": "calculator",
                                                             "arguments": {"expression": expression}}}]}  # fmt: skip
    result = {"role": "tool", "content": f'{{"result": {calculate(expression)}}}'}
    final = {"role": "assistant", "content": task.answer,
             "reasoning_content": f"The calculator says {expression} = {task.expected}." if thinking else None}  # fmt: skip
    system = [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}] if rng.random() < 0.3 else []
    return system + [{"role": "user", "content": task.question}, call, result, final], thinking, task


def chat_documents(tokenizer, rng: random.Random, mix: dict[str, float] | None = None) -> list[Document]:
    """One draw from the chat mix (default CHAT_MIX): one document, or two for a tool episode (the call, then
    the answer)."""
    mix = mix or CHAT_MIX
    kind = rng.choices(list(mix), weights=list(mix.values()))[0]
    if kind == "tool":
        messages, thinking, _ = tool_episode(rng)
        return [assistant_turn_document(tokenizer, messages[:end], [CALCULATOR], thinking)
                for end in (len(messages) - 2, len(messages))]  # fmt: skip
    if kind == "small_talk":
        questions, answer = rng.choice(SMALL_TALK)
        thinking = rng.random() < 0.5
        reasoning = "The user is talking to me; I answer briefly and say what I can do." if thinking else None
        messages = [{"role": "user", "content": rng.choice(questions)},
                    {"role": "assistant", "content": answer, "reasoning_content": reasoning}]  # fmt: skip
        return [assistant_turn_document(tokenizer, messages, None, thinking)]
    messages, task, thinking, tools = exercise_messages(rng, kind)
    return [assistant_turn_document(tokenizer, messages + [reply(task, thinking)], tools, thinking)]


EXCLUDED_DIRS = {"test", "tests", "idle_test", "idlelib", "lib2to3", "site-packages", "turtledemo", "encodings",
                 "ensurepip", "__pycache__", "pydoc_data", "__phello__"}  # fmt: skip


def stdlib_files(held_out: bool = False) -> list[Path]:
    """The standard library's .py files in a fixed shuffled order; one name in twenty is held out."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if not EXCLUDED_DIRS.intersection(p.relative_to(root).parts)]
    key = lambda p: zlib.crc32(p.relative_to(root).as_posix().encode())  # noqa: E731
    return sorted((p for p in files if (key(p) % 20 == 0) == held_out), key=key)


def text_pieces(held_out: bool = False) -> Iterator[str]:
    """Plain text from the standard library: each file cut at blank lines into pieces of ~1,500 characters."""
    for path in stdlib_files(held_out):
        try:
            source = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        piece = ""
        for block in source.split("\n\n"):
            if piece and len(piece) + len(block) > 1500:
                yield piece
                piece = ""
            piece += block[:3000] + "\n\n"
        if piece.strip():
            yield piece


def text_documents(tokenizer, held_out: bool = False) -> Iterator[Document]:
    eos = tokenizer.token_to_id("<|endoftext|>")
    while True:  # the training run may want more text than one pass gives: go round again
        for piece in text_pieces(held_out):
            ids = tokenizer.encode(piece, split_special_tokens=True) + [eos]
            yield Document(ids, [True] * len(ids), splittable=True)


@dataclass
class Batch:
    ids: torch.Tensor  # (B, T) token ids
    targets: torch.Tensor  # (B, T) the next token where it is trained, else -100 (ignored)
    positions: torch.Tensor  # (B, T) RoPE position within each token's document
    mask: torch.Tensor  # (B, 1, T, T) bool: query i sees key j when both are in one document and j <= i
    is_text: torch.Tensor  # (B, T) bool: the token is plain text (else a chat turn), to log the two losses apart


class Packer:
    """Rows of T tokens: whole chat documents, plain text cut to fill what is left and to keep its share."""

    def __init__(self, tokenizer, seed: int, seq_len: int, mix: dict[str, float] | None = None):
        self.tokenizer, self.rng, self.seq_len, self.mix = tokenizer, random.Random(seed), seq_len, mix
        self.texts = text_documents(tokenizer)
        self.chats: list[Document] = []
        self.text_rest: Document | None = None
        self.tokens = self.text_tokens = 0

    def next_text(self, room: int) -> Document:
        doc = self.text_rest or next(self.texts)
        self.text_rest = None if len(doc.ids) <= room else Document(doc.ids[room:], doc.trained[room:], True)
        return Document(doc.ids[:room], doc.trained[:room], True)

    def row(self) -> list[Document]:
        docs, used = [], 0
        while used < self.seq_len:
            room = self.seq_len - used
            if not self.chats and self.text_tokens >= TEXT_SHARE * self.tokens:
                self.chats = chat_documents(self.tokenizer, self.rng, self.mix)
                if max(len(doc.ids) for doc in self.chats) > self.seq_len:
                    raise ValueError(f"a chat turn of {max(len(d.ids) for d in self.chats)} tokens does not fit "
                                     f"in rows of {self.seq_len}; use longer rows")  # fmt: skip
            if self.chats and len(self.chats[0].ids) <= room:
                doc = self.chats.pop(0)
            else:  # text: its share is short, or the next chat turn does not fit in this row
                doc = self.next_text(room)
                self.text_tokens += len(doc.ids)
            docs.append(doc)
            used += len(doc.ids)
            self.tokens += len(doc.ids)
        return docs

    def batch(self, rows: int) -> Batch:
        return collate([self.row() for _ in range(rows)], self.seq_len)


def collate(rows: list[list[Document]], T: int) -> Batch:
    ids, targets, positions, is_text = [], [], [], []
    mask = torch.zeros(len(rows), T, T, dtype=torch.bool)  # (B, T, T)
    for b, docs in enumerate(rows):
        start = 0
        for doc in docs:
            n = len(doc.ids)
            ids += doc.ids
            # token t predicts token t + 1 of its own document, where that token is trained
            targets += [t if trained else -100 for t, trained in zip(doc.ids[1:], doc.trained[1:])] + [-100]
            positions += range(n)
            is_text += [doc.splittable] * n
            mask[b, start : start + n, start : start + n] = causal_mask(T)[:n, :n]  # a block per document
            start += n
    shape = (len(rows), T)
    return Batch(torch.tensor(ids).view(shape), torch.tensor(targets).view(shape), torch.tensor(positions).view(shape),
                 mask[:, None], torch.tensor(is_text).view(shape))  # fmt: skip


@functools.cache
def causal_mask(T: int) -> torch.Tensor:
    return torch.ones(T, T, dtype=torch.bool).tril()  # (T, T)
