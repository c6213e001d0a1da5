"""Random weights of the exact Qwen3 shapes for scripts/gpu_check.py: drawn straight into GPU memory for our
model, or written once as a checkpoint (drawn on the GPU, so 8B takes seconds plus the disk) for what reads
files (the engine workload's load, the load benchmark).

Decode speed does not depend on where the random numbers came from, and a GPU machine has no internet.
"""

from pathlib import Path

import torch
from make_shape_checkpoint import (GB, generation_config, plan_shards, shape_config, shard_file_names, tensor_shapes,
                                   write_json)  # fmt: skip

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
            bos_token_id=0, eos_token_id=1)  # Qwen3's ids (151643...) are outside a 512-token vocabulary  # fmt: skip
# Qwen3-30B-A3B's routing (top-8 of 128 experts) at the tiny widths, for a dry run of the MoE path.
TINY_MOE = {**TINY, "num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 32}


def checkpoint_folder(size: str, device: str, weights: Path) -> Path:
    """The checkpoint of `size`'s shapes under `weights`, written now if it is not there."""
    folder = weights / f"qwen3-{size.lower()}-shapes-gpucheck"
    if (folder / "config.json").exists():
        return folder
    print(f"    writing the {size} checkpoint to {folder}", flush=True)
    return write_checkpoint(size, folder, device)


def write_checkpoint(size: str, folder: Path, device: str) -> Path:
    """Random bf16 weights drawn on `device` (fast on a GPU), one shard at a time; config.json last."""
    from safetensors.torch import save_file

    config = shape_config("0.6B" if size == "tiny" else size, "bfloat16", TINY if size == "tiny" else None)
    folder.mkdir(parents=True, exist_ok=True)
    shapes = tensor_shapes(config)
    weight_map = {}
    for name, keys in zip(shard_file_names(len(shards := plan_shards(shapes, 2, 4 * GB))), shards):
        tensors = {}
        for key in keys:
            t = torch.empty(shapes[key], dtype=torch.bfloat16, device=device).normal_(0, 0.02)
            tensors[key] = (t.add_(1.0) if key.endswith("norm.weight") else t).cpu()
        save_file(tensors, folder / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(keys, name))
        del tensors
    if len(shards) > 1:
        write_json(folder / "model.safetensors.index.json", {"metadata": {}, "weight_map": weight_map})
    write_json(folder / "generation_config.json", generation_config(config))
    write_json(folder / "config.json", config)  # last: a half-written folder has no config
    return folder


def load_or_draw(size: str, device: str, weights: Path, quantize: str | None, optimize: str = "decode"):
    """(model, seconds spent writing a checkpoint): drawn straight into memory (no disk: 8B's 16 GB need not
    be written before the first figure), laid out and quantized as load_model would."""
    return random_model(size, device, quantize, optimize), 0.0


def random_model(size: str, device: str, quantize: str | None, optimize: str | None = "decode"):
    """A model of `size`'s shapes with random bf16 weights drawn straight on `device`: no checkpoint.

    30B-A3B is 61 GB in bf16: it fits an 80 GB GPU but not, beside the dense sizes, the GPU machine's disk,
    and writing and reading 8B back cost the first GPU runs minutes. Built on `meta` in bf16, materialised on
    the device in place, then load_model's own layout step (fusing, int8/int4).
    """
    from qwen3_scratch.kernels.layout import optimize_layout
    from qwen3_scratch.model.config import Qwen3Config
    from qwen3_scratch.model.qwen3 import Qwen3

    tiny = {"tiny": TINY, "tiny-moe": TINY_MOE}.get(size)
    shapes = {"tiny": "0.6B", "tiny-moe": "30B-A3B"}.get(size, size)
    config = Qwen3Config.from_dict(shape_config(shapes, "bfloat16", tiny))
    with torch.device("meta"):
        model = Qwen3(config).to(torch.bfloat16)
    model.to_empty(device=device)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(0, 0.02).add_(1.0 if name.endswith("norm.weight") else 0.0)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.build_rope_tables(device, torch.bfloat16)
    return optimize_layout(model, optimize, quantize, 32 if quantize == "int4" else None).eval()
