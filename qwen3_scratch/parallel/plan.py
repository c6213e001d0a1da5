"""Which part of every weight a rank holds: the split of Qwen3 over N ranks, decided once, checked first.

    q_proj, k_proj, v_proj, gate_proj, up_proj   split by output rows (column parallel): no communication;
    o_proj, down_proj                            split by input columns (row parallel): one all-reduce each;
    embed_tokens, lm_head                        split by vocabulary rows: an all-reduce of the looked-up
                                                 rows, an all-gather of the logits;
    experts (MoE)                                whole experts divided among ranks (expert parallelism);
    norms, the router, q/k-norm                  replicated (small).

KV heads: with K >= N each rank holds K/N of them; with K < N (Qwen3-32B's 8 kv heads at N = 16) each kv
head is replicated on N/K ranks, so every rank still holds exactly the kv head its H/N query heads read.
Anything else (H % N, F % N or E % N not zero) cannot be split evenly and is refused in one line.

Shapes: C hidden_size, H query heads, K kv heads, D head_dim, F intermediate_size, E experts, V vocab.
"""

import dataclasses
from dataclasses import dataclass

from qwen3_scratch.errors import Qwen3Error
from qwen3_scratch.model.config import Qwen3Config

FLAG = "--tensor-parallel-size"


class ParallelError(Qwen3Error):
    """Tensor parallelism cannot start or cannot go on: an impossible size, a rank that died or hung."""


def size_problems(config: Qwen3Config, n: int) -> list[str]:
    """The config's sizes that N ranks cannot split evenly ([] when N works)."""
    H, K, E = config.num_attention_heads, config.num_key_value_heads, config.num_experts
    has_dense_mlp = not E or any(not config.is_moe_layer(i) for i in range(config.num_hidden_layers))
    problems = [
        f"num_attention_heads={H}" if H % n else "",
        f"num_key_value_heads={K}" if (K % n if K >= n else n % K) else "",  # K < N: replicated N/K times
        f"intermediate_size={config.intermediate_size}" if has_dense_mlp and config.intermediate_size % n else "",
        f"num_experts={E}" if E % n else "",
    ]
    return [p for p in problems if p]


def check_size(config: Qwen3Config, n: int) -> None:
    """Refuse an N that does not divide the model evenly, naming the flag and the sizes that do."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ParallelError(f"{FLAG} must be an integer >= 1, got {n!r}")
    problems = size_problems(config, n)
    if problems:
        fits = [str(m) for m in range(1, 65) if not size_problems(config, m)]
        raise ParallelError(f"{FLAG} {n} cannot split this model: {n} does not divide {', '.join(problems)}; "
                            f"use one of {', '.join(fits)}")  # fmt: skip


@dataclass(frozen=True)
class ShardPlan:
    """Rank `rank` of `world`: its config and the row/column ranges it reads from each checkpoint tensor."""

    config: Qwen3Config  # the whole model's
    rank: int
    world: int

    @property
    def local_config(self) -> Qwen3Config:
        """The shard's own shapes: heads, kv heads, MLP width and experts per rank; vocabulary, layers and
        context are the model's (logits are gathered to the whole vocabulary)."""
        c = self.config
        return dataclasses.replace(c, num_attention_heads=c.num_attention_heads // self.world,
                                   num_key_value_heads=self.kv_heads,
                                   intermediate_size=max(1, c.intermediate_size // self.world))  # fmt: skip

    @property
    def kv_heads(self) -> int:
        return max(1, self.config.num_key_value_heads // self.world)

    def kv_head_range(self) -> range:
        """The kv heads this rank holds: its K/N, or (K < N) the one its query heads read."""
        K, n = self.config.num_key_value_heads, self.world
        first = self.rank * K // n if K >= n else self.rank // (n // K)
        return range(first, first + self.kv_heads)

    @property
    def vocab_rows(self) -> int:
        """Rows of embed_tokens/lm_head per rank: V/N rounded up (the last rank's are padded with zeros)."""
        return -(-self.config.vocab_size // self.world)

    def vocab_range(self) -> range:
        start = self.rank * self.vocab_rows
        return range(min(start, self.config.vocab_size), min(start + self.vocab_rows, self.config.vocab_size))

    def expert_range(self) -> range:
        per = self.config.num_experts // self.world
        return range(self.rank * per, (self.rank + 1) * per)

    def part(self, name: str) -> tuple[int, range] | None:
        """(dim, range) of checkpoint tensor `name` this rank reads, None for all of it (replicated)."""
        c, n, r = self.config, self.world, self.rank
        D = c.head_dim
        leaf = name.rsplit(".", 2)[-2] if name.endswith((".weight", ".bias")) else name
        if ".experts." in name:
            return None  # whole experts; which ones is expert_range's business
        if leaf == "q_proj":
            per = c.num_attention_heads // n * D
            return 0, range(r * per, (r + 1) * per)
        if leaf in ("k_proj", "v_proj"):
            heads = self.kv_head_range()
            return 0, range(heads.start * D, heads.stop * D)
        if leaf == "o_proj" and name.endswith(".weight"):
            per = c.num_attention_heads // n * D
            return 1, range(r * per, (r + 1) * per)
        if leaf in ("gate_proj", "up_proj"):
            per = c.intermediate_size // n
            return 0, range(r * per, (r + 1) * per)
        if leaf == "down_proj":
            per = c.intermediate_size // n
            return 1, range(r * per, (r + 1) * per)
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return 0, self.vocab_range()
        return None
