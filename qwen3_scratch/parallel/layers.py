"""The modules a rank's shard swaps in where a layer's output needs the other ranks' parts.

Column-parallel layers (q/k/v, gate/up: each rank a slice of the output rows) need nothing: they are the
model's own nn.Linear over a slice of the matrix. What needs communication, each with one collective:

  RowParallel            o_proj, down_proj: each rank multiplies its slice of the input columns, the partial
                         products are summed over ranks (all-reduce);
  VocabParallelEmbedding each rank looks up the ids in its slice of the vocabulary, zeros elsewhere, all-reduce;
  VocabParallelHead      each rank scores its slice of the vocabulary, logits all-gathered (B, T, V);
  ExpertParallelMoE      each rank runs its E/N experts on the tokens routed to them, all-reduce.

Each wraps a plain nn.Linear (or the embedding's weight) that kernels/ may still swap for a faster
product at load: the collective stays outside it. The sums run in another order than on one device, so
fp32 logits differ by float rounding (tests/test_tensor_parallel.py: within 1e-5 relative).

Shapes: B batch, T tokens, N tokens (B x T flattened), C hidden_size, V vocab, Vr vocab rows per rank,
k experts per token.
"""

import torch
import torch.distributed as dist
from torch import nn

from qwen3_scratch.model.config import Qwen3Config
from qwen3_scratch.model.moe import Expert, SparseMoeBlock, route


class RowParallel(nn.Module):
    """A linear layer over this rank's input columns, its output summed over all ranks."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.linear = linear  # (C_out, C_in / N): kernels/ may replace it; the all-reduce stays here

    @property
    def weight(self) -> torch.Tensor:
        return self.linear.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)  # this rank's share of every output element
        dist.all_reduce(y)
        return y


class VocabParallelEmbedding(nn.Module):
    """Rows [first, first + Vr) of the embedding table; ids outside them look up zeros here."""

    def __init__(self, weight: torch.Tensor, first: int, vocab_size: int):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # (Vr, C), the last rank's padded with zeros
        self.first, self.vocab_size = first, vocab_size

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.first  # (B, T)
        mine = (local >= 0) & (local < self.weight.shape[0])
        x = nn.functional.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)  # (B, T, C)
        x = x * mine[..., None]  # exactly one rank holds each id, so the sum is that rank's row
        dist.all_reduce(x)
        return x


class VocabParallelHead(nn.Module):
    """lm_head over this rank's vocabulary rows; the logits of every rank gathered, padding cut off."""

    def __init__(self, linear: nn.Linear, vocab_size: int, world: int):
        super().__init__()
        self.linear = linear  # (Vr, C); tied models share the embedding's rows
        self.vocab_size, self.world = vocab_size, world

    @property
    def weight(self) -> torch.Tensor:
        return self.linear.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mine = self.linear(x).contiguous()  # (B, T, Vr)
        parts = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(parts, mine)
        return torch.cat(parts, dim=-1)[..., : self.vocab_size]  # (B, T, V)


class ExpertParallelMoE(SparseMoeBlock):
    """SparseMoeBlock holding only experts [first, first + E/N); the router is replicated.

    Why experts and not tensor parallelism inside each expert: every rank already holds every token
    (attention's all-reduce leaves the hidden states replicated), so a rank needs no dispatch, only to
    run its own experts on the tokens routed to them; each expert stays one whole matrix (235B-A22B: 16
    experts of width 1536 per rank at N = 8, instead of 128 slivers of width 192), and the layer costs
    one all-reduce, as a dense MLP does. The price is balance: a token's k experts may sit on few ranks.
    """

    def __init__(self, config: Qwen3Config, experts: range):
        nn.Module.__init__(self)
        self.top_k, self.norm_topk_prob = config.num_experts_per_tok, config.norm_topk_prob
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)  # the router, all E
        self.first = experts.start
        # Named by their global index, as the checkpoint names them (mlp.experts.17.up_proj.weight).
        self.experts = nn.ModuleDict({str(e): Expert(config.hidden_size, config.moe_intermediate_size) for e in experts})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        x = x.reshape(B * T, C)  # (N, C)
        weights, chosen = route(self.gate(x), self.top_k, self.norm_topk_prob)  # (N, k) each
        outputs = x.new_zeros(*chosen.shape, C)  # (N, k, C): zero for the choices other ranks run
        last = self.first + len(self.experts)
        for e in chosen[(chosen >= self.first) & (chosen < last)].unique().tolist():
            token, slot = torch.where(chosen == e)  # which tokens chose e, as which of their k choices
            outputs[token, slot] = self.experts[str(e)](x[token])
        y = (outputs * weights[..., None]).sum(dim=1)  # (N, C): this rank's experts' share
        dist.all_reduce(y)
        return y.view(B, T, C)
