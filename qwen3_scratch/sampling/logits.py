"""Sampling: next-token logits (B, V) -> next token ids (B,). It knows nothing about text or the model.

Every function here is pure: logits in, logits (or ids) out, randomness only from an explicit
`torch.Generator`. None of them reads a tensor value back to Python (no `.item()`, no branching on
tensor values), so `sample` runs inside a GPU decode loop without stalling it.

The filters compose in transformers' order: temperature -> top-k -> top-p -> min-p. Each returns
logits with the tokens it removes set to -inf, so the next filter (and softmax) simply ignores them.
Temperature 0 means greedy: argmax of the raw logits, every other setting ignored.

`LogitsFilter` holds only what this module needs (temperature, top-k, top-p, min-p); a request's
whole settings are `SamplingParams` (params.py), whose `logits_filter` is one of these.

Shapes: B batch rows, V vocab.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from qwen3_scratch.errors import GenerationError, printable

# float32 softmax + cumsum puts each cumulative probability a few ulps (~1e-7) off its exact value,
# so a set whose true mass is exactly p can come out as p - 1ulp and drag in one more token.
# Counting "within 1e-6 of p" as reaching p makes the boundary follow the exact arithmetic.
_TOP_P_SLACK = 1e-6

# Below this, a temperature is greedy in all but name, and far enough below it logits / t overflow
# float32 to inf (1e-300 is 0 in float32): ask for greedy as 0 instead.
MIN_TEMPERATURE = 1e-4

# The id `sample` gives a row whose logits are not finite (NaN, inf): not a token. Whoever reads the
# tokens must stop the generation there (the pipeline raises GenerationError).
NON_FINITE = -2


def require(ok: bool, label: str, rule: str, value) -> None:
    """Unless ok: GenerationError "`label` must be `rule`, got `value`" (the value made printable)."""
    if not ok:
        raise GenerationError(f"{label} must be {rule}, got {printable(repr(value), limit=80)}")


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_temperature(value, label: str = "--temperature") -> None:
    ok = is_number(value) and math.isfinite(value) and (value == 0 or value >= MIN_TEMPERATURE)
    require(ok, label, f"0 (greedy) or a finite number >= {MIN_TEMPERATURE:g}", value)


def check_top_k(value, label: str = "--top-k") -> None:
    require(is_int(value) and value >= 0, label, "an integer >= 0", value)


def check_top_p(value, label: str = "--top-p") -> None:
    # written as `0 < p <= 1` so that NaN fails too
    require(is_number(value) and 0 < value <= 1, label, "in (0, 1]", value)


def check_min_p(value, label: str = "--min-p") -> None:
    # min_p = 1 would drop every token but exact ties with the top one: greedy in disguise, so refuse it
    require(is_number(value) and 0 <= value < 1, label, "in [0, 1)", value)


@dataclass(frozen=True)
class LogitsFilter:
    """How to turn logits into a token. The defaults are plain sampling from softmax(logits).

    Frozen and hashable: the engine groups the rows of a step that share one filter."""

    temperature: float = 1.0  # divides the logits; 0 means greedy (argmax), the other fields ignored
    top_k: int = 0  # keep the k highest logits (ties with the k-th all kept); 0 = off
    top_p: float = 1.0  # keep the smallest top set whose probability reaches p (nucleus); 1 = off
    min_p: float = 0.0  # drop tokens less likely than min_p x the top token's probability; 0 = off

    def __post_init__(self):
        # messages name the CLI flag, since that is where a bad value usually comes from
        check_temperature(self.temperature)
        check_top_k(self.top_k)
        check_top_p(self.top_p)
        check_min_p(self.min_p)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / t: t < 1 sharpens the distribution, t > 1 flattens it. t = 0 is greedy (see `sample`)."""
    if temperature <= 0:
        raise GenerationError(f"--temperature must be > 0 to scale logits, got {temperature!r} (0 means greedy)")
    if temperature == 1:
        return logits
    return logits / temperature


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k highest logits per row. Like transformers, every token tied with the k-th logit is
    kept too: a tie has no principled winner, and keeping all of them does not depend on topk's order."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = logits.topk(k, dim=-1).values[..., -1:]  # (B, 1) the k-th highest logit
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus filter: keep the smallest set of most likely tokens whose total probability reaches p.

    A token is kept when the tokens ranked above it hold less than p, so the token that crosses p is
    kept (transformers' rule) and the top token always is. Ties are ranked by token id (stable sort),
    so when only part of a tie fits, the lower ids are kept.
    """
    if p >= 1:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)  # (B, V) each
    drop_sorted = outside_nucleus(sorted_logits, p)
    drop = drop_sorted.scatter(-1, order, drop_sorted)  # (B, V) back in vocab order
    return logits.masked_fill(drop, float("-inf"))


def outside_nucleus(ranked: torch.Tensor, p: float) -> torch.Tensor:
    """(B, n) logits ranked most likely first -> (B, n) bool, True for the tokens top-p drops: those the tokens
    ranked above already hold p of the probability (within _TOP_P_SLACK); never the top one."""
    probs = ranked.float().softmax(dim=-1)  # (B, n)
    mass_above = F.pad(probs.cumsum(dim=-1)[..., :-1], (1, 0))  # (B, n) probability ranked above each
    drop = mass_above >= p - _TOP_P_SLACK
    drop[..., 0] = False  # the top token survives even a tiny p
    return drop


def min_p_filter(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Drop tokens whose probability is below min_p x the top token's probability.

    Unlike top-p, the cut scales with the model's confidence: a confident step keeps few tokens,
    an uncertain one keeps many. The top token always survives (its ratio is 1 > min_p).
    """
    if min_p <= 0:
        return logits
    probs = logits.float().softmax(dim=-1)  # (B, V)
    threshold = min_p * probs.amax(dim=-1, keepdim=True)  # (B, 1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def top_k_then_top_p(logits: torch.Tensor, k: int, p: float) -> torch.Tensor:
    """top_p_filter(top_k_filter(logits, k), p) with the nucleus found among the top-k survivors alone.

    After top-k only the survivors (k of them, more with ties at the k-th) have any probability, so ranking
    them is enough: the same order (by logit, ties by lower id), the same probabilities (their softmax, summed
    over the survivors rather than over V entries, equal but for the last bit, which _TOP_P_SLACK absorbs),
    the same kept set. Sorting all 151,936 logits of a row instead took 5.5 ms of a CPU's sampled step (Qwen3's
    defaults: top_k 20, top_p 0.95), longer than the rest of the draw. The survivors' count is read on the
    host, so this is for a CPU; a GPU, which sorts fast and must not sync, takes the two filters."""
    values, ids = logits.topk(k, dim=-1)  # (B, k)
    n = int((logits >= values[..., -1:]).sum(dim=-1).max())  # survivors: ties with the k-th count too
    if n > k:  # ties at the k-th: every survivor, and -inf in the rows that have fewer
        values, ids = top_k_filter(logits, k).topk(n, dim=-1)
    ids, by_id = ids.sort(dim=-1)  # ties are ranked by token id, as top_p_filter's stable sort ranks them
    ranked, order = values.gather(-1, by_id).sort(dim=-1, descending=True, stable=True)
    kept = ranked.masked_fill(outside_nucleus(ranked, p), float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(-1, ids.gather(-1, order), kept)  # (B, V)


def filter_logits(logits: torch.Tensor, params: LogitsFilter) -> torch.Tensor:
    """All filters in transformers' order, on float32 logits (B, V). Not for greedy params."""
    logits = apply_temperature(logits.float(), params.temperature)
    k, p = params.top_k, params.top_p
    if 0 < k < logits.shape[-1] and p < 1 and logits.device.type == "cpu" and not torch.compiler.is_compiling():
        logits = top_k_then_top_p(logits, k, p)
    else:
        logits = top_p_filter(top_k_filter(logits, k), p)
    return min_p_filter(logits, params.min_p)


def greedy(logits: torch.Tensor, finite: torch.Tensor | None = None) -> torch.Tensor:
    """sample's greedy draw: the first index of the largest logit, (B, V) -> (B,), NON_FINITE for a row that
    is not all finite. Widening to fp32 is exact and leaves the order alone; on a CPU torch's argmax over
    151936 bf16 logits takes ~0.57 ms, over their fp32 copy ~0.19 ms (by blocks, argmax_by_blocks, ~0.07).
    The finiteness check reads the row once more, as a minimum (NaN and -inf show there) and the winner (+inf
    and NaN win argmax), not isfinite's three passes and `all`: one step's greedy draw at 1 thread 1.1 -> 0.35
    ms (Intel Xeon); by blocks, 0.47 -> 0.15 ms (2 threads, AMD EPYC Zen 3)."""
    wide = logits.float()  # (B, V)
    if wide.is_cpu and wide.shape[-1] % ARGMAX_BLOCK == 0:
        tokens, best = argmax_by_blocks(wide)
    else:
        tokens = wide.argmax(dim=-1)  # (B,)
        best = wide.gather(-1, tokens[:, None])[:, 0]  # (B,)
    if finite is None:
        finite = torch.isfinite(wide.amin(dim=-1)) & torch.isfinite(best)
    return torch.where(finite, tokens, NON_FINITE)


ARGMAX_BLOCK = 128  # ids a block of argmax_by_blocks holds (Qwen3's 151,936 are 1,187 of them)


def argmax_by_blocks(wide: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, V) fp32, V a multiple of ARGMAX_BLOCK -> argmax(dim=-1) (B,) and each row's largest value (B,), the same
    ids as argmax's, the first on ties, NaN counting as the largest. torch's CPU argmax reduces without vectors
    (~170 us over 151,936 floats); its amax uses them (~12 us): so the largest of each block first, then argmax
    over those and within the first block that holds the row's largest (the first such block holds its first
    index)."""
    B, V = wide.shape
    blocks = wide.view(B, V // ARGMAX_BLOCK, ARGMAX_BLOCK)  # (B, V/128, 128)
    block_max = blocks.amax(dim=-1)  # (B, V/128): NaN where a block holds one, as argmax puts NaN first
    block = block_max.argmax(dim=-1)  # (B,)
    within = blocks[torch.arange(B), block].argmax(dim=-1)  # (B,)
    return block * ARGMAX_BLOCK + within, block_max.gather(-1, block[:, None])[:, 0]


def all_finite(x: torch.Tensor) -> torch.Tensor:
    """(B, V) -> (B,) bool: no NaN or inf in the row. By its smallest and largest entries (both reductions carry a
    NaN through), which read the row without making isfinite's (B, V) mask: at 16 x 151,936, 0.18 ms against
    4.2 ms on a CPU (2 threads, AMD EPYC)."""
    return torch.isfinite(x.amin(dim=-1)) & torch.isfinite(x.amax(dim=-1))


def sample(logits: torch.Tensor, params: LogitsFilter, generator: torch.Generator | None = None,
           finite: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """Draw one token per row: (B, V) logits -> (B,) long ids on the logits' device.

    `generator` must live on the logits' device; None uses torch's global RNG.

    The draw is an exponential race, argmax(probs / E) with E ~ Exponential(1) per token: E_i / p_i is
    exponential with rate p_i, and the smallest of independent exponentials is token i with
    probability p_i / sum(p). We prefer it to torch.multinomial because multinomial checks its input
    on the host (a GPU sync every step) while the race is an elementwise op plus an argmax: no sync,
    and it compiles into a graph. Filtered tokens have p = 0 and can never win. (Under
    torch.compile(fullgraph=True) pass generator=None: dynamo cannot trace a Generator argument.)

    A row whose logits (or probabilities) are not all finite gets NON_FINITE instead of a token: the
    argmax of NaNs is a meaningless id (often 0, forever after). Marking the row here, on the device,
    costs no host sync; the consumer, which reads every step's tokens anyway, stops on it. `finite` (B,)
    bool replaces that check when the caller made it on the model's own logits, before logit processing
    set banned tokens to -inf on purpose (sampling/processors.py).
    """
    if params.greedy:
        return greedy(logits, finite)
    finite = all_finite(logits) if finite is None else finite  # (B,)
    probs = filter_logits(logits, params).softmax(dim=-1)  # (B, V) float32
    finite &= all_finite(probs)
    noise = exponential_noise(probs, generator)
    return torch.where(finite, (probs / noise).argmax(dim=-1), NON_FINITE)


def exponential_noise(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """E ~ Exponential(1), one per entry of probs, never 0: the race's noise (`sample`)."""
    return exponential_from_uniform_(torch.empty_like(probs).uniform_(generator=generator))


def exponential_from_uniform_(u: torch.Tensor) -> torch.Tensor:
    """U ~ Uniform[0, 1) -> E = -log(1 - U) ~ Exponential(1), in place, never 0.

    Made from uniforms because on a CPU torch's own `exponential_` costs 5-6x as much: 2.9 ms against 0.57 for
    one row of Qwen3's 151,936 ids, and 184 ms against 47 for 64 rows (1 thread, AMD EPYC). Apart from the draw
    so that a batch whose rows draw from their own generators (seeded requests) transforms them all at once:
    four ops a step, not four a row. An exact 0 (U = 0) would turn p / E = 0 / 0 into NaN, which argmax ranks
    above every number: it is raised to the smallest normal float."""
    return u.neg_().log1p_().neg_().clamp_min_(torch.finfo(u.dtype).tiny)
