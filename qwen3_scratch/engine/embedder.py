"""Embeddings: texts in, one unit vector each out, the way Qwen3-Embedding makes them.

Qwen3-Embedding is the Qwen3 body without lm_head (checkpoint/weights.py loads it headless). Its model
card's recipe, followed here:
  - a text's ids end with <|endoftext|> (appended when the tokenizer did not put it there);
  - the embedding is the final hidden state of that last token (causal attention: the one token that
    has seen the whole text), L2-normalised;
  - queries carry an instruction, `Instruct: {task}\\nQuery:{query}` (`format_query`); documents none;
  - Matryoshka: the first `dimensions` coordinates are an embedding too, normalised again after the cut.
Token-id inputs are taken as the client tokenized them, with nothing appended.

Texts of different lengths run as one left-padded batch, so every row's last token sits in the last
column; batches are cut at `max_batch_tokens` (rows x longest row) to bound memory.

Shapes: B rows, T tokens, C hidden size.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from qwen3_scratch.errors import GenerationError
from qwen3_scratch.model.kv_cache import attention_mask
from qwen3_scratch.model.qwen3 import Qwen3
from qwen3_scratch.text.tokenizer import Tokenizer

END_OF_TEXT = "<|endoftext|>"


def format_query(task: str, query: str) -> str:
    """A query with its task instruction, in the format Qwen3-Embedding was trained on."""
    return f"Instruct: {task}\nQuery:{query}"


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """vLLM's shape: `out.outputs.embedding`."""

    prompt_token_ids: list[int]
    outputs: EmbeddingOutput


class Embedder:
    def __init__(self, model: Qwen3, tokenizer: Tokenizer, max_batch_tokens: int = 8192):
        self.model, self.tokenizer, self.max_batch_tokens = model, tokenizer, max_batch_tokens
        self.end_of_text = tokenizer.token_to_id(END_OF_TEXT)
        self.context = model.config.max_position_embeddings

    @property
    def hidden_size(self) -> int:
        return self.model.config.hidden_size

    def token_ids(self, text: str) -> list[int]:
        ids = self.tokenizer.encode(text)
        if self.end_of_text is not None and (not ids or ids[-1] != self.end_of_text):
            ids.append(self.end_of_text)
        return ids

    def check(self, prompts: list[list[int]], dimensions: int | None) -> None:
        """Raise GenerationError, naming the field, for inputs that cannot be embedded."""
        if not prompts:
            raise GenerationError("input is empty: send a string, a list of strings or of token ids")
        if dimensions is not None and not (isinstance(dimensions, int) and 1 <= dimensions <= self.hidden_size):
            raise GenerationError(f"dimensions must be an integer from 1 to {self.hidden_size}, got {dimensions!r}")
        vocab = self.model.config.vocab_size
        for i, ids in enumerate(prompts):
            if not ids or len(ids) > self.context:
                raise GenerationError(f"input {i} is {len(ids)} tokens; it must be 1 to {self.context} (the context)")
            if any(not 0 <= t < vocab for t in ids):
                raise GenerationError(f"input {i} has token ids outside [0, {vocab})")

    @torch.no_grad()
    def embed_ids(self, prompts: list[list[int]], dimensions: int | None = None) -> torch.Tensor:
        """(N, dimensions or C) float32, each row of unit length, in the order of prompts."""
        self.check(prompts, dimensions)
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths pad less
        out = torch.empty(len(prompts), dimensions or self.hidden_size)
        batch: list[int] = []
        for i in order + [None]:
            if batch and (i is None or (len(batch) + 1) * len(prompts[i]) > self.max_batch_tokens):
                out[batch] = self._embed_batch([prompts[j] for j in batch], dimensions).cpu()
                batch = []
            if i is not None:
                batch.append(i)
        return out

    @torch.inference_mode()
    def _embed_batch(self, prompts: list[list[int]], dimensions: int | None) -> torch.Tensor:
        T, device = max(len(p) for p in prompts), self.model.device
        ids = torch.tensor([[0] * (T - len(p)) + p for p in prompts], device=device)  # (B, T) left-padded
        valid = torch.tensor([[False] * (T - len(p)) + [True] * len(p) for p in prompts], device=device)
        positions = (valid.cumsum(-1) - 1).clamp(min=0)  # (B, T): each row counts from its first real token
        # A padding query sees itself too: a row with no key at all would come out NaN and reach real rows
        # through the values (0 x NaN). Real queries never see padding keys.
        mask = attention_mask(torch.arange(T, device=device), valid) | torch.eye(T, dtype=torch.bool, device=device)
        hidden = self.model.hidden_states(ids, positions, mask)[:, -1].float()  # (B, C): each row's last token
        return F.normalize(hidden[:, :dimensions] if dimensions else hidden, dim=-1)
