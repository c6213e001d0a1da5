"""Logit processing: what a request changes in the model's scores before they are sampled.

Pure functions of the logits and the tokens so far, shared by the simple loops (generation/) and the
engine, so a penalty means the same thing on every path. The order is vLLM's (its v1 sampler): the
grammar's mask (structured.py, applied by the caller first), then

    bad words -> min_tokens -> logit_bias -> repetition -> frequency -> presence penalty

and then temperature and the filters (logits.py). Each step is the published rule:
  - bad_words: a word's last token is banned where the output already ends with the word's other tokens;
  - min_tokens: the stop ids (EOS, stop_token_ids) are banned until that many tokens were generated
    (stop strings are held back by text/stop.py);
  - logit_bias: OpenAI's, added to the logit of each listed id;
  - repetition_penalty (CTRL, transformers' RepetitionPenaltyLogitsProcessor, vLLM): every token seen in
    the prompt or the output has its logit divided by the penalty if positive, multiplied if negative;
  - frequency_penalty, presence_penalty (OpenAI): logit -= frequency x count in the output, and
    -= presence once if the token is in the output at all. The prompt does not count for these two.

Shapes: B rows, V vocab, N tokens generated so far per row.
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LogitsProcessing:
    """A request's processing, made hashable (tuples), with every value already checked (params.py)."""

    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs
    min_tokens: int = 0
    bad_words: tuple[tuple[int, ...], ...] = ()  # each word as token ids

    @property
    def active(self) -> bool:
        """False when these settings leave every logit alone (the common case: skip the work)."""
        return self != LogitsProcessing()

    @property
    def needs_prompt(self) -> bool:
        return self.repetition_penalty != 1.0


def ban_bad_words(logits: torch.Tensor, outputs: torch.Tensor, words) -> torch.Tensor:
    """Ban each word's last token in the rows whose output ends with the word's earlier tokens."""
    for word in words:
        *head, last = word
        if not head:
            logits[:, last] = float("-inf")
        elif outputs.shape[1] >= len(head):
            tail = outputs[:, outputs.shape[1] - len(head) :]  # (B, len(head))
            match = (tail == torch.tensor(head, device=outputs.device)).all(dim=1)  # (B,)
            logits[:, last] = logits[:, last].masked_fill(match, float("-inf"))
    return logits


def apply_min_tokens(logits: torch.Tensor, generated: int, min_tokens: int, stop_ids) -> torch.Tensor:
    """Before min_tokens tokens were generated, no stop id may be drawn."""
    if generated < min_tokens and len(stop_ids):
        logits[:, list(stop_ids)] = float("-inf")
    return logits


def apply_logit_bias(logits: torch.Tensor, bias) -> torch.Tensor:
    if bias:
        ids = torch.tensor([i for i, _ in bias], device=logits.device)
        logits[:, ids] += torch.tensor([b for _, b in bias], device=logits.device, dtype=logits.dtype)
    return logits


def output_counts(outputs: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(B, N) token ids -> (B, V) how many times each id occurs in the row."""
    counts = torch.zeros(outputs.shape[0], vocab_size, device=outputs.device)
    return counts.scatter_add_(1, outputs, torch.ones_like(outputs, dtype=counts.dtype))


def apply_penalties(logits: torch.Tensor, counts: torch.Tensor, prompt_seen: torch.Tensor | None,
                    processing: LogitsProcessing) -> torch.Tensor:  # fmt: skip
    """Repetition (prompt and output), then frequency and presence (output only), as vLLM orders them."""
    if processing.repetition_penalty != 1.0:
        seen = counts > 0 if prompt_seen is None else (counts > 0) | prompt_seen  # (B, V)
        p = processing.repetition_penalty
        penalised = torch.where(logits > 0, logits / p, logits * p)
        logits = torch.where(seen, penalised, logits)
    if processing.frequency_penalty:
        logits = logits - processing.frequency_penalty * counts
    if processing.presence_penalty:
        logits = logits - processing.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def process_logits(logits: torch.Tensor, outputs: torch.Tensor, processing: LogitsProcessing,
                   prompt_seen: torch.Tensor | None = None, stop_ids=()) -> torch.Tensor:  # fmt: skip
    """The whole chain on float32 logits (B, V), in vLLM's order; returns new logits.

    outputs (B, N): each row's generated ids so far; prompt_seen (B, V) bool: ids in each row's
    prompt (only the repetition penalty reads it); stop_ids: what min_tokens holds back."""
    logits = logits.float().clone()
    logits = ban_bad_words(logits, outputs, processing.bad_words)
    logits = apply_min_tokens(logits, outputs.shape[1], processing.min_tokens, stop_ids)
    logits = apply_logit_bias(logits, processing.logit_bias)
    counts = output_counts(outputs, logits.shape[-1])
    return apply_penalties(logits, counts, prompt_seen, processing)


def prompt_mask(prompts: torch.Tensor, vocab_size: int, valid: torch.Tensor | None = None) -> torch.Tensor:
    """(B, T) prompt ids (valid (B, T) False on padding) -> (B, V) bool: which ids each prompt holds."""
    marks = torch.ones_like(prompts) if valid is None else valid.long()  # padding adds 0 to its id
    counts = torch.zeros(prompts.shape[0], vocab_size, dtype=torch.long, device=prompts.device)
    return counts.scatter_add_(1, prompts, marks) > 0


class LoopProcessing:
    """`process_logits` inside a token loop: keeps each row's generated ids as a tensor (no host sync).

    prompts (B, T) with valid (B, T) (False on left padding); stop_ids: what min_tokens holds back."""

    def __init__(self, processing: LogitsProcessing, prompts: torch.Tensor, vocab_size: int, stop_ids=(),
                 valid: torch.Tensor | None = None):  # fmt: skip
        self.processing, self.stop_ids = processing, list(stop_ids)
        self.seen = prompt_mask(prompts, vocab_size, valid) if processing.needs_prompt else None  # (B, V)
        self.outputs = torch.empty(prompts.shape[0], 0, dtype=torch.long, device=prompts.device)  # (B, N)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        return process_logits(logits, self.outputs, self.processing, self.seen, self.stop_ids)

    def push(self, tokens: torch.Tensor) -> None:
        """tokens (B,): this step's ids (negative marks, for finished rows, count as id 0: never read again)."""
        self.outputs = torch.cat([self.outputs, tokens.clamp_min(0)[:, None]], dim=1)
