"""Qwen3-MoE's sparse MLP: a router picks k of E expert SwiGLUs for each token and mixes their outputs.

    router logits (N, E) -> softmax in fp32 -> top-k -> renormalise (norm_topk_prob) -> cast to the
    activation dtype -> each chosen expert's SwiGLU on its tokens -> times its weight -> sum over the k

This is the order of operations of transformers' modeling_qwen3_moe.py with its default ("grouped_mm")
experts forward, so bf16 results match: a token's k weighted outputs are added in one sum over k,
not accumulated expert after expert into a bf16 buffer.

Experts are stored one module per expert under the Hub's key names (`mlp.experts.7.up_proj.weight`), so
each expert's weights are a view of the checkpoint file and choosing an expert is indexing a list.
Three ways to compute the (N, k, C) expert outputs, equal by test (tests/test_moe.py):
  - experts_loop:    the readable one: for each expert that received tokens, run it on those tokens;
  - experts_decode:  one token (batch-1 decode): run exactly its k experts, reading k of E experts' weights
                     (8 of 128 for 30B-A3B) and no index tensors at all;
  - experts_grouped: many tokens (prefill): one sort lays the (token, choice) pairs out expert by expert,
                     so each active expert runs one matmul over a contiguous block of rows.

Shapes: N tokens (batch x time, flattened), C hidden_size, E num_experts, k num_experts_per_tok,
I moe_intermediate_size.
"""

import torch
import torch.nn.functional as F
from torch import nn

from .config import Qwen3Config


class Expert(nn.Module):
    """One expert: a SwiGLU MLP of width I (768 for 30B-A3B, against the dense 8B's 12288)."""

    def __init__(self, hidden_size: int, width: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, width, bias=False)
        self.up_proj = nn.Linear(hidden_size, width, bias=False)
        self.down_proj = nn.Linear(width, hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # (.., C) -> (.., I) -> (.., C)


def route(router_logits: torch.Tensor, k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits (N, E) -> (weights (N, k) in the logits' dtype, chosen experts (N, k)).

    The softmax runs in fp32: in bf16, 128 probabilities of ~1/128 each lose most of their digits,
    and the top-k choice would flip between near-ties. The weights are cast back only at the end.
    """
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)  # (N, E)
    weights, chosen = torch.topk(probs, k, dim=-1)  # (N, k), largest first
    if norm_topk_prob:  # 30B-A3B and 235B-A22B: the k weights sum to 1, as if the others did not exist
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), chosen


class SparseMoeBlock(nn.Module):
    """Replaces the dense MLP in MoE layers: x (B, T, C) -> (B, T, C)."""

    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.top_k, self.norm_topk_prob = config.num_experts_per_tok, config.norm_topk_prob
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)  # the router
        self.experts = nn.ModuleList(
            Expert(config.hidden_size, config.moe_intermediate_size) for _ in range(config.num_experts)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        x = x.reshape(B * T, C)  # (N, C): routing is per token, whatever row it came from
        weights, chosen = route(self.gate(x), self.top_k, self.norm_topk_prob)  # (N, k) each
        outputs = self.experts_decode(x, chosen) if B * T == 1 else self.experts_grouped(x, chosen)  # (N, k, C)
        return (outputs * weights[..., None]).sum(dim=1).view(B, T, C)

    def experts_loop(self, x: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """(N, k, C): the output of expert chosen[n, j] on token n. The readable reference."""
        outputs = x.new_empty(*chosen.shape, x.shape[-1])  # (N, k, C)
        for e in chosen.unique().tolist():  # only the experts that received tokens
            token, slot = torch.where(chosen == e)  # (n_e,) each: which tokens chose e, as which choice
            outputs[token, slot] = self.experts[e](x[token])
        return outputs

    def experts_decode(self, x: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """Same as experts_loop, one (token, expert) pair at a time: for a single token, k matrix-vector
        products over exactly the k chosen experts' weights; the only host sync is reading the k ids."""
        outputs = x.new_empty(*chosen.shape, x.shape[-1])  # (N, k, C)
        for n, experts in enumerate(chosen.tolist()):
            for j, e in enumerate(experts):
                outputs[n, j] = self.experts[e](x[n])
        return outputs

    def experts_grouped(self, x: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """Same as experts_loop, with the pairs sorted by expert: one sort and one count instead of a
        search per expert, and each expert's rows already contiguous for its matmuls."""
        N, k = chosen.shape
        order = torch.argsort(chosen.reshape(-1), stable=True)  # (N*k,) pair indices, expert by expert
        counts = torch.bincount(chosen.reshape(-1), minlength=len(self.experts)).tolist()  # pairs per expert
        rows = x[order // k]  # (N*k, C): each pair's token, in expert order
        grouped = torch.empty_like(rows)
        start = 0
        for e, count in enumerate(counts):
            if count:
                grouped[start : start + count] = self.experts[e](rows[start : start + count])
                start += count
        outputs = torch.empty_like(grouped)
        outputs[order] = grouped  # back to (token, choice) order
        return outputs.view(N, k, -1)  # (N, k, C)
