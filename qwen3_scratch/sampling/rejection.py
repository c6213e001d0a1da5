"""Checking proposed tokens against the target model's logits: which to keep, and the token after them.

Speculative decoding (generation/speculative.py) lets something cheap propose k tokens d_1..d_k, then
runs the target model once over them, which gives k+1 rows of logits: row i is the target's
distribution for the token after d_i (row 0, for d_1 itself). These functions turn those rows into
the tokens the round produces, such that the output is exactly what the target alone would produce:

  greedy    keep d_i while it is the target's own argmax at that position; then add the target's
            argmax at the first disagreement (or after d_k). The tokens are plain greedy decoding's.
  sampling  the standard rejection sampling (Leviathan et al. 2023, Chen et al. 2023): with p the
            target's and q the proposer's distribution at a position (both after the same filters:
            temperature, top-k, top-p, min-p), keep d with probability min(1, p(d) / q(d)); at the first
            rejection, draw the replacement from max(0, p - q), normalised; if all k are kept, draw
            one more from p. Each produced token is then distributed exactly as p (the two branches
            add up to p(x) for every x). A proposer without a distribution (prompt lookup) proposes
            with certainty: q is a point mass, so d is kept with probability p(d) and the
            replacement is drawn from p without d.

Pure functions of logits and an explicit torch.Generator, as logits.py. Unlike `sample`, they read
the answer back to the host (the caller needs the number of kept tokens to go on).

Shapes: k proposed tokens, V vocab.
"""

import torch

from .logits import NON_FINITE, LogitsFilter, exponential_noise, filter_logits, sample


def distribution(logits: torch.Tensor, params: LogitsFilter) -> torch.Tensor:
    """What `sample` draws from, as probabilities: (k, V) logits -> (k, V) float32 (not for greedy)."""
    return filter_logits(logits, params).softmax(dim=-1)


def draw(probs: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """One token from probs (V,), by `sample`'s exponential race: argmax(probs / E), E ~ Exponential(1)
    (it uses the generator as `sample` does, so a round that checks nothing draws what `sample` would)."""
    return int((probs / exponential_noise(probs, generator)).argmax())


def verify_greedy(target_logits: torch.Tensor, proposed: list[int]) -> list[int]:
    """The kept prefix of `proposed` plus the target's next token. target_logits (k+1, V).

    NON_FINITE from a row whose logits are NaN or inf ends the round there (no token equals it)."""
    targets = sample(target_logits, LogitsFilter(temperature=0.0)).tolist()  # (k+1,) argmax per row
    kept = 0
    while kept < len(proposed) and proposed[kept] == targets[kept]:
        kept += 1
    return proposed[:kept] + [targets[kept]]


def verify_sampled(target_logits: torch.Tensor, proposed: list[int], proposal_probs: torch.Tensor | None,
                   params: LogitsFilter, generator: torch.Generator | None = None) -> list[int]:  # fmt: skip
    """Rejection sampling (see the module docstring). target_logits (k+1, V); proposal_probs (k, V),
    the distributions the proposals were drawn from, or None for proposals made with certainty."""
    k = len(proposed)
    p = distribution(target_logits, params)  # (k+1, V)
    finite = torch.isfinite(p).all(dim=-1).tolist()  # (k+1,) a NaN row is no distribution
    q = proposal_probs
    if q is None:  # a point mass on each proposed token
        q = torch.zeros_like(p[:k]).scatter_(1, torch.tensor(proposed, device=p.device)[:, None], 1.0)  # (k, V)
    rows, ids = torch.arange(k, device=p.device), torch.tensor(proposed, device=p.device, dtype=torch.long)
    u = torch.rand(k, generator=generator, device=p.device)
    # keep d with probability min(1, p(d)/q(d)): u < p/q, written without dividing (q(d) > 0: d was drawn from q)
    keep = (u * q[rows, ids] < p[rows, ids]).tolist()
    kept = 0
    while kept < k and keep[kept] and finite[kept]:
        kept += 1
    if not finite[kept]:
        return proposed[:kept] + [NON_FINITE]
    if kept == k:
        return proposed + [draw(p[k], generator)]
    residual = (p[kept] - q[kept]).clamp_min(0)  # (V,) what p has that q over-proposed
    # p > q somewhere whenever d was rejected (p(d) < q(d) and both sum to 1); only rounding could
    # leave nothing, and then p itself is the right answer to within that rounding
    residual = torch.where(residual.sum() > 0, residual, p[kept])
    return proposed[:kept] + [draw(residual / residual.sum(), generator)]


def verify(target_logits: torch.Tensor, proposed: list[int], proposal_probs: torch.Tensor | None,
           params: LogitsFilter, generator: torch.Generator | None = None) -> list[int]:  # fmt: skip
    """The tokens one round produces (1 to k+1): the kept proposals, then one token from the target."""
    if params.greedy:
        return verify_greedy(target_logits, proposed)
    return verify_sampled(target_logits, proposed, proposal_probs, params, generator)
