"""One rank's shard of a checkpoint: only its slices are read, so its memory is about 1/N of the model.

The checkpoint is checked exactly as checkpoint/weights.py checks it for one device (the same functions,
on the whole model's shapes, before any data is read). Then the rank builds its shard on the `meta`
device from its own shapes (plan.py's local config), swaps in the parallel modules (layers.py), and
fills every parameter from `safe_open(...).get_slice(name)[rows or columns]`: the `safetensors` library
copies out just those bytes. Each tensor opens its shard anew and closes it at once, so the pages of the
file that a column slice touches (every row of o_proj and down_proj) leave the process with it instead
of adding up to the whole file in its resident memory. Peak resident memory per rank on the 0.6B shapes:
docs/performance.md ("Tensor parallelism").

Shapes: C hidden_size, Vr vocabulary rows per rank.
"""

from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from qwen3_scratch.checkpoint.weights import (
    _check_expert_count,
    _check_matches_model,
    check_config_matches_tensors,
    headless_entries,
    read_checkpoint_index,
    split_fused_experts,
)
from qwen3_scratch.errors import CheckpointError, printable
from qwen3_scratch.kernels.layout import DEFAULT_GROUP_SIZE, optimize_layout
from qwen3_scratch.model.config import DTYPES, Qwen3Config
from qwen3_scratch.model.moe import SparseMoeBlock
from qwen3_scratch.model.qwen3 import Qwen3

from .layers import ExpertParallelMoE, RowParallel, VocabParallelEmbedding, VocabParallelHead
from .plan import ShardPlan, check_size


def read_checked_entries(folder: Path, config: Qwen3Config, world: int) -> dict:
    """The checkpoint's tensors, checked against config.json and the whole model's shapes; N checked too."""
    entries = split_fused_experts(read_checkpoint_index(folder), config)
    if headless_entries(entries) is not None:
        raise CheckpointError(f"{printable(folder)} is an embedding checkpoint (no lm_head); tensor parallelism "
                              "is for generative checkpoints")  # fmt: skip
    check_config_matches_tensors(config, entries, folder)
    _check_expert_count(entries, config)
    with torch.device("meta"):
        _check_matches_model(entries, Qwen3(config), config)
    check_size(config, world)
    return entries


def build_shard(plan: ShardPlan) -> Qwen3:
    """The rank's model on `meta`: its own shapes, the parallel modules in place (no memory yet)."""
    local, C = plan.local_config, plan.config.hidden_size
    with torch.device("meta"):
        model = Qwen3(local)
        for i, layer in enumerate(model.model.layers):
            layer.self_attn.o_proj = RowParallel(layer.self_attn.o_proj)
            if isinstance(layer.mlp, SparseMoeBlock):
                layer.mlp = ExpertParallelMoE(local, plan.expert_range())
            else:
                layer.mlp.down_proj = RowParallel(layer.mlp.down_proj)
        vocab = plan.vocab_range()
        model.model.embed_tokens = VocabParallelEmbedding(torch.empty(plan.vocab_rows, C), vocab.start, local.vocab_size)
        model.lm_head = VocabParallelHead(nn.Linear(C, plan.vocab_rows, bias=False), local.vocab_size, plan.world)
    return model


def checkpoint_name(parameter: str) -> str:
    """Our parameter name -> the checkpoint's key: the parallel wrappers add a `.linear` level."""
    return parameter.replace(".linear.", ".")


def read_part(entry, plan: ShardPlan, name: str) -> torch.Tensor:
    """This rank's part of one checkpoint tensor, read through the library's slice (only those bytes)."""
    with safe_open(entry.file, framework="pt") as shard:
        view = shard.get_slice(entry.name)
        if entry.rows is not None:  # one expert inside a fused (E, ...) tensor: (e,) or (e, rows)
            e, *rows = entry.rows
            view_rows = rows[0] if rows else slice(None)
            return view[e : e + 1, view_rows][0]
        part = plan.part(name)
        if part is None:
            return view[:]
        dim, span = part
        return view[span.start : span.stop] if dim == 0 else view[:, span.start : span.stop]


def load_shard(folder, rank: int, world: int, device="cpu", dtype=torch.float32, optimize=None, quantize=None,
               group_size: int = DEFAULT_GROUP_SIZE) -> Qwen3:  # fmt: skip
    """Rank `rank`'s shard of the checkpoint in `folder`, in eval mode, laid out by kernels/ like load_model's."""
    folder = Path(folder)
    dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    config = Qwen3Config.from_json(folder / "config.json")
    entries = read_checked_entries(folder, config, world)
    plan = ShardPlan(config, rank, world)
    model = build_shard(plan)
    tied = config.tie_word_embeddings
    for name, _ in list(model.named_parameters()):
        key = checkpoint_name(name)
        if tied and key == "lm_head.weight":
            continue  # the embedding's rows, tied below
        tensor = read_part(entries[key], plan, key).to(device=device, dtype=dtype).contiguous()  # column slices are strided
        if key == "model.embed_tokens.weight" or key == "lm_head.weight":
            tensor = pad_rows(tensor, plan.vocab_rows)
        module_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(module_name), attr, nn.Parameter(tensor, requires_grad=False))
    if tied:
        model.lm_head.linear.weight = model.model.embed_tokens.weight
    model.build_rope_tables(device, dtype)
    return optimize_layout(model, optimize, quantize, group_size).eval()


def pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """(r, C) -> (rows, C) with zero rows after: the last rank's slice when N does not divide V."""
    if tensor.shape[0] == rows:
        return tensor
    return torch.cat([tensor, tensor.new_zeros(rows - tensor.shape[0], *tensor.shape[1:])])
