"""Log-probabilities: what the model thought of each token, for `logprobs`, `top_logprobs` and `echo`.

Which logits: the model's own, before the request's processing, penalties, temperature and filters
(vLLM's default, `--logprobs-mode raw_logprobs`). So a token's logprob is log_softmax of the model's
logits at that position, whatever the request sampled with: what evaluation harnesses score answers by,
and the same number for the prompt (echo) as for the output.

Shapes: R rows (one per token scored), V vocab, k top entries.
"""

from dataclasses import dataclass

import torch

MAX_LOGPROBS = 20  # the most top entries a request may ask for (OpenAI's top_logprobs limit; vLLM's default)


@dataclass
class TokenLogprob:
    """One scored token: its logprob, its rank among all tokens (1 = the likeliest), and the top k."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]  # (id, logprob), likeliest first


def score_tokens(logits: torch.Tensor, token_ids, k: int) -> list[TokenLogprob]:
    """logits (R, V) and the token actually taken at each row (R,) -> one TokenLogprob per row."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # (R, V)
    ids = torch.as_tensor(token_ids, device=logits.device).long()
    chosen = logprobs.gather(1, ids[:, None])[:, 0]  # (R,)
    rank = (logprobs > chosen[:, None]).sum(dim=-1) + 1  # (R,) ties share the better rank
    top = logprobs.topk(k, dim=-1) if k > 0 else None  # (R, k) values and ids
    out = []
    for r, (token, lp, rk) in enumerate(zip(ids.tolist(), chosen.tolist(), rank.tolist())):
        pairs = list(zip(top.indices[r].tolist(), top.values[r].tolist())) if top is not None else []
        out.append(TokenLogprob(token, lp, rk, pairs))
    return out
