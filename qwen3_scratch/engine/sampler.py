"""Each sequence's next token, with what its request asked for: grammar, logit processing, logprobs.

One step's rows of logits (one per sequence that reached its newest token) go through, per row, in
vLLM's order: the grammar's mask (sampling/structured.py), the request's logit processing
(sampling/processors.py: bad words, min_tokens, logit_bias, penalties), then greedy argmax or
temperature and filters and a draw from the sequence's own generator (sampling/logits.py). Rows that
ask for none of it (the common case) skip straight to the batched argmax or draw. Logprobs are scored
on the model's own logits, before any of it (sampling/logprobs.py says why).

`SamplingState` is what a sequence carries for this between steps.
"""

from dataclasses import dataclass, field

import torch

from qwen3_scratch.sampling.logits import exponential_from_uniform_, exponential_noise, filter_logits
from qwen3_scratch.sampling.logprobs import TokenLogprob, score_tokens
from qwen3_scratch.sampling.processors import LogitsProcessing, process_logits
from qwen3_scratch.sampling.after_reasoning import GrammarAfterReasoning
from qwen3_scratch.sampling.structured import Matcher, apply_bitmask

from .scheduler import Sequence
from .transfer import to_device


@dataclass
class SamplingState:
    """A sequence's sampling state beyond its generator: kept on `Sequence.sampling`."""

    processing: LogitsProcessing | None = None  # None: the request changes no logit
    matcher: Matcher | GrammarAfterReasoning | None = None  # its place in the grammar, for structured output
    prompt_seen: torch.Tensor | None = None  # (V,) bool, ids in the prompt (for the repetition penalty)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per output token, if asked
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)  # one per prompt token, if asked

    @property
    def active(self) -> bool:
        """True when this sequence's logits need more than the plain draw."""
        return self.processing is not None or self.matcher is not None


def processed_row(seq: Sequence, row: torch.Tensor) -> torch.Tensor:
    """One sequence's logits (V,) after its grammar mask and its logit processing."""
    state = seq.sampling
    logits = row.float()[None]  # (1, V)
    mask = state.matcher.bitmask() if state.matcher is not None else None  # None: free (still reasoning)
    if mask is not None:
        logits = apply_bitmask(logits, mask[None])
    if state.processing is not None:
        outputs = torch.tensor([seq.output_ids], device=row.device, dtype=torch.long).reshape(1, -1)  # (1, N)
        if state.prompt_seen is None and state.processing.needs_prompt:
            prompt = torch.tensor(seq.token_ids[: seq.num_prompt_tokens], device=row.device)
            state.prompt_seen = torch.zeros(row.shape[-1], dtype=torch.bool, device=row.device)
            state.prompt_seen[prompt] = True
        seen = None if state.prompt_seen is None else state.prompt_seen[None]
        logits = process_logits(logits, outputs, state.processing, seen, sorted(seq.eos_ids))
    return logits[0]


def sample(seqs: list[Sequence], rows: list[torch.Tensor]) -> list[int]:
    """One token per sequence. Rows with the same filter share its work; each draws with its own
    generator, so a seeded request gets the same tokens whatever else is in the batch. Nothing but the
    generators changes: the caller then `record`s each sequence's token."""
    return draw(seqs, rows).tolist() if seqs else []


def draw(seqs: list[Sequence], rows: list[torch.Tensor]) -> torch.Tensor:
    """sample's tokens as a tensor (N,) on the rows' device, read back by nobody: an overlapped step (engine.py)
    feeds them to the next step's forward there, and reads them when that step is queued. Nothing here waits for
    the device, unless a row asks for work that does (a grammar, logit processing, top-k)."""
    raw = torch.stack(rows)  # (N, V) the model's logits
    logits = raw
    special = [i for i, seq in enumerate(seqs) if seq.sampling is not None and seq.sampling.active]
    if special:
        logits = raw.float().clone()
        for i in special:
            logits[i] = processed_row(seqs[i], raw[i])
    groups: dict = {}  # a filter (None: greedy) -> its rows
    for i, seq in enumerate(seqs):
        chosen = seq.params.logits_filter
        groups.setdefault(None if chosen.greedy else chosen, []).append(i)
    tokens = None if len(groups) == 1 else torch.empty(len(seqs), dtype=torch.long, device=raw.device)
    for params, index in groups.items():
        if params is None:  # fp32: the same argmax (bf16 widens exactly), at 16 x 151,936 2.2 ms against 4.6 ms
            # for torch's bf16 argmax on the 2-core EPYC (docs/performance.md, serving); over the greedy rows alone
            drawn = rows_at(logits, index).float().argmax(dim=-1)
        else:
            probs = filter_logits(rows_at(logits, index), params).softmax(dim=-1)  # (n, V)
            # a seeded request's rows draw from their own generators; the others' noise is drawn in one call
            drawn = race(probs, [seqs[i].generator if seqs[i].params.seed is not None else None for i in index])
        if tokens is None:
            return drawn
        tokens.index_copy_(0, to_device(index, raw.device), drawn)
    return tokens


def rows_at(logits: torch.Tensor, index: list[int]) -> torch.Tensor:
    """logits' rows at index (distinct rows, in order): logits itself when that is every row. Indexing by a list
    copies the list to the device, which on a GPU waits for the step's forward; the index goes by
    transfer.to_device instead."""
    return logits if len(index) == logits.shape[0] else logits.index_select(0, to_device(index, logits.device))


def race(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One draw from each row of probs (n, V): the exponential race of sampling.sample, argmax(p / E), with
    E ~ Exp(1) from the row's own generator where it has one (a seeded request: the same (V,) draw as it would
    make alone, whatever else is in the batch), and from torch's for the other rows together.

    Batched: one division and one argmax for all rows, left on the device. Row by row (an argmax and an int()
    each) it was 64 host syncs a step at 64 rows, which on a GPU left the card idle most of the step."""
    unseeded = [row for row, g in enumerate(generators) if g is None]
    if len(unseeded) == len(generators):
        noise = exponential_noise(probs)
    else:  # each seeded row's uniforms from its own generator, then all rows made exponential at once
        noise = torch.empty_like(probs)
        for row, g in enumerate(generators):
            if g is not None:
                noise[row].uniform_(generator=g)
        if unseeded:
            at = to_device(unseeded, probs.device)
            noise.index_copy_(0, at, probs.new_empty(len(unseeded), probs.shape[1]).uniform_())
        exponential_from_uniform_(noise)
    return (probs / noise).argmax(dim=-1)


def record(seq: Sequence, raw: torch.Tensor, token: int) -> None:
    """After the draw, for one sequence: score its token if it asked for logprobs (on the model's logits
    raw (V,)), and advance its grammar. Apart from `sample`, so that a fault here stays with this one
    sequence and a batch's draw can be retried without advancing anyone's grammar twice."""
    if seq.params.logprobs is not None:
        (scored,) = score_tokens(raw[None], [token], seq.params.logprobs)
        seq.sampling.logprobs.append(scored)
    if seq.sampling is not None and seq.sampling.matcher is not None:
        seq.sampling.matcher.accept(token)


def score_prompt(seq: Sequence, logits: torch.Tensor, start: int) -> None:
    """Prompt logprobs from one prefill chunk: logits (T, V) at positions start.. predict the tokens after them."""
    state, k = seq.sampling, seq.params.prompt_logprobs
    if not state.prompt_logprobs:
        state.prompt_logprobs = [None] * seq.num_prompt_tokens  # the first token has no context to score it
    end = min(start + logits.shape[0], seq.num_prompt_tokens - 1)  # the last position predicts the output
    if end > start:
        targets = seq.token_ids[start + 1 : end + 1]
        for offset, lp in enumerate(score_tokens(logits[: end - start], targets, k)):
            state.prompt_logprobs[start + 1 + offset] = lp
