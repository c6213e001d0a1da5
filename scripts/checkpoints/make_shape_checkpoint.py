"""Write a random-weight Qwen3 checkpoint with the exact published shapes of one size.

    python scripts/checkpoints/make_shape_checkpoint.py --size 0.6B          # -> weights/qwen3-0.6b-shapes
    python scripts/checkpoints/make_shape_checkpoint.py --size 8B --out /data/qwen3-8b-shapes

The benchmarks need the real shapes (the real bytes on disk, the real matmul sizes), not the real
weights, so this skips a download. The folder is laid out like the Hub's: `config.json`,
`generation_config.json`, and either one `model.safetensors` (0.6B) or shards of at most ~4 GB plus
`model.safetensors.index.json` (1.7B and up), under the exact Hugging Face key names. No tokenizer:
the benchmarks feed random token ids.

Tensors are generated one at a time and written one shard at a time, so memory stays at about one
shard: an 8B (16 GB) checkpoint can be written without ever holding the whole model.
"""

import argparse
import json
import math
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script from anywhere: `python scripts/checkpoints/make_shape_checkpoint.py`
    sys.path.insert(0, str(ROOT))

from qwen3_scratch.checkpoint.weights import read_checkpoint_index  # noqa: E402
from qwen3_scratch.errors import CheckpointError  # noqa: E402
from qwen3_scratch.model.config import DTYPES, Qwen3Config  # noqa: E402
from qwen3_scratch.model.sizes import QWEN3_MOE_SIZES, config_dict, moe_config_dict  # noqa: E402

GB = 10**9  # the Hub's "4GB" shards are decimal gigabytes
DEFAULT_SHARD_GB = 4.0
INDEX_NAME = "model.safetensors.index.json"


def default_out(size: str) -> Path:
    return ROOT / "weights" / f"qwen3-{size.lower()}-shapes"


def shape_config(size: str = "0.6B", dtype: str = "bfloat16", overrides: dict | None = None) -> dict:
    """The config.json this script writes for `size`; `overrides` shrink it for tests (same code path)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use one of {sorted(DTYPES)}")
    base = moe_config_dict(size) if size in QWEN3_MOE_SIZES else config_dict(size)
    return {**base, **(overrides or {}), "torch_dtype": dtype}


def generation_config(config: dict) -> dict:
    """Qwen3's recommended sampling settings; a chat turn ends at <|im_end|>, a document at <|endoftext|>."""
    bos = config["bos_token_id"]
    return {
        "bos_token_id": bos,
        "do_sample": True,
        "eos_token_id": [config["eos_token_id"], bos],
        "pad_token_id": bos,
        "temperature": 0.6,
        "top_k": 20,
        "top_p": 0.95,
    }


def tensor_shapes(config: dict, tied_head_copy: bool = False) -> dict[str, tuple[int, ...]]:
    """Every tensor of the checkpoint, in the Hub's key names and the order they are generated.

    nn.Linear stores its weight as (out_features, in_features). `lm_head.weight` is written when the
    embeddings are untied (8B and up), or with tied_head_copy: the Hub's tied Qwen3-0.6B file stores
    it anyway, as a copy of the embedding (311 tensors, 1,503,300,328 bytes instead of ~1.19 GB).
    """
    C, V, D = config["hidden_size"], config["vocab_size"], config["head_dim"]
    H, K = config["num_attention_heads"], config["num_key_value_heads"]
    shapes = {"model.embed_tokens.weight": (V, C)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (C,)
        shapes[p + "self_attn.q_proj.weight"] = (H * D, C)
        shapes[p + "self_attn.k_proj.weight"] = (K * D, C)
        shapes[p + "self_attn.v_proj.weight"] = (K * D, C)
        shapes[p + "self_attn.o_proj.weight"] = (C, H * D)
        shapes[p + "self_attn.q_norm.weight"] = (D,)
        shapes[p + "self_attn.k_norm.weight"] = (D,)
        shapes[p + "post_attention_layernorm.weight"] = (C,)
        shapes.update(mlp_shapes(config, i))
    shapes["model.norm.weight"] = (C,)
    if tied_head_copy or not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (V, C)
    return shapes


def mlp_shapes(config: dict, i: int) -> dict[str, tuple[int, ...]]:
    """Layer i's MLP tensors: the dense SwiGLU, or (qwen3_moe) the router and every expert's SwiGLU."""
    C, p = config["hidden_size"], f"model.layers.{i}.mlp."
    moe = config.get("model_type") == "qwen3_moe" and Qwen3Config.from_dict(config).is_moe_layer(i)
    Fi = config["moe_intermediate_size"] if moe else config["intermediate_size"]
    swiglu = {"gate_proj.weight": (Fi, C), "up_proj.weight": (Fi, C), "down_proj.weight": (C, Fi)}
    if not moe:
        return {p + name: shape for name, shape in swiglu.items()}
    shapes = {p + "gate.weight": (config["num_experts"], C)}  # the router
    for e in range(config["num_experts"]):
        shapes.update({f"{p}experts.{e}.{name}": shape for name, shape in swiglu.items()})
    return shapes


def random_tensor(name: str, shape: tuple[int, ...], generator: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """N(0, 0.02) for matrices, as transformers initialises them; 1 + noise for norm weights.

    Drawn directly in the target dtype, so an 8B embedding never exists as a 2x larger fp32 copy.
    Norms are near 1 but not exactly 1, so a model that forgets to multiply by them fails parity.
    """
    tensor = torch.randn(shape, generator=generator, dtype=dtype)
    if name.endswith("norm.weight"):
        return tensor.mul_(0.1).add_(1.0)
    return tensor.mul_(0.02)


def plan_shards(shapes: dict[str, tuple[int, ...]], itemsize: int, max_bytes: int) -> list[list[str]]:
    """Fill shards in key order up to max_bytes each (a larger tensor gets a shard of its own)."""
    shards: list[list[str]] = [[]]
    filled = 0
    for name, shape in shapes.items():
        nbytes = itemsize * math.prod(shape)
        if shards[-1] and filled + nbytes > max_bytes:
            shards.append([])
            filled = 0
        shards[-1].append(name)
        filled += nbytes
    return shards


def shard_file_names(num_shards: int) -> list[str]:
    """The Hub's names: one `model.safetensors`, or `model-0000i-of-0000N.safetensors`."""
    if num_shards == 1:
        return ["model.safetensors"]
    return [f"model-{k:05d}-of-{num_shards:05d}.safetensors" for k in range(1, num_shards + 1)]


def is_complete(out: Path, config: dict, tied_head_copy: bool = False) -> bool:
    """True if `out` already holds this exact checkpoint: same config, every tensor whole and as expected."""
    if not (out / "config.json").exists() or json.loads((out / "config.json").read_text()) != config:
        return False
    try:
        entries = read_checkpoint_index(out)  # checks each shard's header and that no file is truncated
    except CheckpointError:
        return False
    dtype = DTYPES[config["torch_dtype"]]
    expected = tensor_shapes(config, tied_head_copy)
    return set(entries) == set(expected) and all(
        entries[name].shape == shape and entries[name].dtype == dtype for name, shape in expected.items()
    )


def write_weights(out: Path, config: dict, seed: int, max_shard_bytes: int, tied_head_copy: bool = False) -> None:
    """Generate and save one shard at a time; an interrupted run leaves no complete-looking file."""
    dtype = DTYPES[config["torch_dtype"]]
    shapes = tensor_shapes(config, tied_head_copy)
    shards = plan_shards(shapes, dtype.itemsize, max_shard_bytes)
    names = shard_file_names(len(shards))
    # One generator walked in key order: the weights are the same whatever the shard size.
    generator = torch.Generator().manual_seed(seed)

    def draw(key: str) -> torch.Tensor:
        if key == "lm_head.weight" and config["tie_word_embeddings"]:
            # A tied head stored anyway must equal the embedding, which was the first tensor drawn
            # from the seed: draw it again rather than keep the embedding's shard in memory.
            return random_tensor("model.embed_tokens.weight", shapes[key], torch.Generator().manual_seed(seed), dtype)
        return random_tensor(key, shapes[key], generator, dtype)

    weight_map = {}
    for file_name, keys in zip(names, shards):
        tensors = {key: draw(key) for key in keys}
        partial = out / (file_name + ".partial")
        save_file(tensors, partial, metadata={"format": "pt"})
        partial.rename(out / file_name)
        weight_map.update(dict.fromkeys(keys, file_name))
        del tensors  # free this shard before generating the next
    if len(names) > 1:
        total_size = sum(dtype.itemsize * math.prod(shape) for shape in shapes.values())
        index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
        write_json(out / INDEX_NAME, index)


def remove_old_weights(out: Path) -> None:
    """Delete a previous checkpoint's weight files, so shards of an older layout cannot linger."""
    for path in [*out.glob("model*.safetensors"), *out.glob("model*.safetensors.partial"), out / INDEX_NAME]:
        path.unlink(missing_ok=True)


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def make_shape_checkpoint(
    size: str = "0.6B",
    out=None,
    dtype: str = "bfloat16",
    seed: int = 0,
    max_shard_size_gb: float | None = None,
    overrides: dict | None = None,
    force: bool = False,
    tied_head_copy: bool = False,
) -> Path:
    """Write (or keep, if already complete) a random checkpoint of `size`'s shapes; returns its folder.

    max_shard_size_gb: None -> 4 GB shards, as the Hub's Qwen3 repos use; a checkpoint that fits in one
        shard is written as a single `model.safetensors` with no index.
    overrides: config.json values to change (tests shrink the model this way).
    tied_head_copy: also store a tied lm_head as a copy of the embedding, as the Hub's 0.6B file does.
    """
    out = Path(out) if out is not None else default_out(size)
    config = shape_config(size, dtype, overrides)
    if not force and is_complete(out, config, tied_head_copy):
        return out
    if (out / "config.json").exists() and not force:
        existing = json.loads((out / "config.json").read_text())
        if existing != config:
            raise FileExistsError(f"{out} holds a different checkpoint; pass force=True (--force) to overwrite it")
    out.mkdir(parents=True, exist_ok=True)
    remove_old_weights(out)
    # config.json goes last: until it is written, is_complete() cannot mistake a half-written folder.
    (out / "config.json").unlink(missing_ok=True)
    write_json(out / "generation_config.json", generation_config(config))
    gb = DEFAULT_SHARD_GB if max_shard_size_gb is None else max_shard_size_gb
    write_weights(out, config, seed, int(gb * GB), tied_head_copy)
    write_json(out / "config.json", config)
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="Write a random Qwen3 checkpoint with the exact shapes of one size.")
    parser.add_argument("--size", default="0.6B", help="0.6B, 1.7B, 4B, 8B, 14B, 32B, 30B-A3B or 235B-A22B (default 0.6B)")
    parser.add_argument("--out", default=None, help="folder to write (default weights/qwen3-<size>-shapes)")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES), help="stored dtype (default bfloat16)")
    parser.add_argument("--seed", type=int, default=0, help="seed for the random weights")
    parser.add_argument("--max-shard-size-gb", type=float, default=None, help="shard size (default 4, as the Hub)")
    parser.add_argument(
        "--tied-head-copy", action="store_true", help="store a tied lm_head too, as the Hub's Qwen3-0.6B file does"
    )
    parser.add_argument("--force", action="store_true", help="rewrite even if the folder holds a complete checkpoint")
    args = parser.parse_args(argv)
    out = Path(args.out) if args.out else default_out(args.size)
    config = shape_config(args.size, args.dtype)
    if not args.force and is_complete(out, config, args.tied_head_copy):
        print(f"exists: {out} already holds a complete Qwen3-{args.size}-shaped checkpoint (--force rewrites it)")
        return
    make_shape_checkpoint(
        args.size, out, args.dtype, args.seed, args.max_shard_size_gb, force=args.force, tied_head_copy=args.tied_head_copy
    )
    files = sorted(p.name for p in out.iterdir())
    total = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    print(f"wrote a random Qwen3-{args.size}-shaped checkpoint to {out} ({total / GB:.2f} GB): {', '.join(files)}")


if __name__ == "__main__":
    main()
