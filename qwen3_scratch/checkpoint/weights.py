"""Load a Hugging Face Qwen3 checkpoint straight into our model.

The model is built on the `meta` device (shapes only, no memory), then every parameter becomes a
view of its shard's bytes, memory-mapped by the `safetensors` library: on CPU in the stored dtype
nothing is copied at all (the OS pages weights in as they are used, and they count once, as page
cache); for another dtype or a GPU each tensor is cast/copied from the mapping straight into its
final place. Either way there is never a full second copy of the model in RAM. (A mapped file must
not be rewritten in place while the model lives; replacing it, as a download does, is safe.)

Everything is checked *before* any data is read, so a bad checkpoint fails with one CheckpointError
naming the file and the tensor, never half-loaded:
  - the file format by the `safetensors` library itself (shards.py), the reference reader, which
    refuses every malformed header; we only explain its refusals;
  - config.json against the tensors the files list (layer count, embedding and layer-0 shapes),
    before a model is built from it, so a config claiming 10^7 layers fails in milliseconds;
  - then the model-level rules, which are ours: every parameter named exactly once, shapes and
    dtypes as config.json says, a tied lm_head equal to the embedding.

Qwen3-Embedding checkpoints are the body alone, saved from transformers' Qwen3Model: their keys have no
`model.` prefix (`embed_tokens.weight`, `layers.0...`, `norm.weight`) and there is no lm_head, whatever
config.json's `architectures` ("Qwen3ForCausalLM" in Qwen's repos) and `tie_word_embeddings` (false in
the 8B's) say. Such a checkpoint loads as a headless Qwen3 (`lm_head` None), with the same strict rules.
"""

import contextlib
import re
from pathlib import Path

import torch
from torch import nn

from qwen3_scratch.errors import CheckpointError, printable
from qwen3_scratch.files import read_json
from qwen3_scratch.kernels.layout import DEFAULT_GROUP_SIZE, GROUP_SIZES, LAYOUTS, SCHEMES, optimize_layout
from qwen3_scratch.model.config import DTYPES, Qwen3Config
from qwen3_scratch.model.qwen3 import Qwen3

from .shards import TensorEntry, read_safetensors_header

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
LAYER_NAME = re.compile(r"model\.layers\.(\d{1,9})\.")


def checkpoint_files(folder: Path) -> list[Path]:
    """The weight files: those named by model.safetensors.index.json, or the single model.safetensors.

    Whether each is present and whole is for open_shard to say.
    """
    weight_map = read_weight_map(folder)
    if weight_map is not None:
        return [folder / name for name in sorted(set(weight_map.values()))]
    if (folder / SINGLE_FILE).exists():
        return [folder / SINGLE_FILE]
    hint = " (pytorch .bin weights are not supported)" if any(folder.glob("*.bin")) else ""
    raise CheckpointError(f"{folder} has neither {SINGLE_FILE} nor {INDEX_FILE}{hint}; download the checkpoint again")


def read_weight_map(folder: Path) -> dict[str, str] | None:
    """The index's {tensor name: shard file name}, or None for a single-file checkpoint.

    Shard names must be plain file names in the folder: an index must not point anywhere else.
    """
    index = folder / INDEX_FILE
    if not index.exists():
        return None
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index} is not a valid safetensors index (no weight_map of file names); "
                              "download it again")  # fmt: skip
    for shard in set(weight_map.values()):
        if shard in ("", ".", "..") or "/" in shard or "\\" in shard or "\0" in shard:
            raise CheckpointError(
                f"{index}: shard name {printable(repr(shard))} is not a file name in the checkpoint folder; "
                "download the checkpoint again"
            )
    return weight_map


def read_checkpoint_index(folder: Path) -> dict[str, TensorEntry]:
    """Every tensor in the checkpoint -> where it lives, checked against the index json."""
    entries: dict[str, TensorEntry] = {}
    for file in checkpoint_files(folder):
        for name, entry in read_safetensors_header(file).items():
            if name in entries:
                raise CheckpointError(
                    f"{printable(file)}: tensor {printable(name)} is also in {printable(entries[name].file.name)}; "
                    "corrupt checkpoint"
                )
            entries[name] = entry
    for name, shard in (read_weight_map(folder) or {}).items():
        if name not in entries or entries[name].file.name != shard:
            found = entries[name].file.name if name in entries else "no shard"
            raise CheckpointError(
                f"{folder / INDEX_FILE}: says {printable(name)} is in {printable(shard)}, but it is in "
                f"{printable(found)}; download the checkpoint again"
            )
    return entries


def check_config_matches_tensors(config: Qwen3Config, entries: dict[str, TensorEntry], folder: Path) -> None:
    """config.json's sizes against the tensors the weight files list, before a model is built from them.

    Cheap (a few names and shapes), so a config claiming 10^7 layers or a vocabulary larger than the
    embedding fails here, naming both files, instead of after building a model of that size.
    """
    weights = folder / (INDEX_FILE if (folder / INDEX_FILE).exists() else SINGLE_FILE)
    layers = {int(m.group(1)) for name in entries if (m := LAYER_NAME.match(name))}
    if layers != set(range(config.num_hidden_layers)):
        held = f"layers 0..{max(layers)} ({len(layers)} of them)" if layers else "no layers"
        raise CheckpointError(
            f"{folder / 'config.json'} says num_hidden_layers={config.num_hidden_layers}, but {printable(weights)} "
            f"holds {held}; the config and the weights are from different models"
        )
    C, V, Fi, D = config.hidden_size, config.vocab_size, config.intermediate_size, config.head_dim
    H, K = config.num_attention_heads, config.num_key_value_heads
    first = "model.layers.0."
    implied = {
        "model.embed_tokens.weight": (V, C),
        first + "self_attn.q_proj.weight": (H * D, C),
        first + "self_attn.k_proj.weight": (K * D, C),
        first + "self_attn.q_norm.weight": (D,),
    }
    if config.is_moe_layer(0):
        implied[first + "mlp.experts.0.gate_proj.weight"] = (config.moe_intermediate_size, C)
    else:
        implied[first + "mlp.gate_proj.weight"] = (Fi, C)
    for name, shape in implied.items():
        if name not in entries:
            raise CheckpointError(f"{printable(weights)} has no tensor {name}, which config.json implies; "
                                  "wrong or partial files?")  # fmt: skip
        if entries[name].shape != shape:
            raise CheckpointError(
                f"{printable(entries[name].file)}: tensor {name} has shape {list(entries[name].shape)} but "
                f"{folder / 'config.json'} implies {list(shape)}; the config and the weights are from different models"
            )


def split_fused_experts(entries: dict[str, TensorEntry], config: Qwen3Config) -> dict[str, TensorEntry]:
    """Checkpoint tensors -> model parameters, for MoE checkpoints written in transformers 5's fused layout.

    The Hub's Qwen3-MoE repos store each expert's weights under its own keys, which are our parameter
    names. transformers 5 holds (and, with save_pretrained(save_original_format=False), writes) each
    layer's experts as two stacked tensors instead:
        mlp.experts.gate_up_proj (E, 2I, C): expert e's gate_proj rows then its up_proj rows
        mlp.experts.down_proj    (E, C, I)
    Each expert's slice of those is a contiguous run of bytes, so it becomes an entry of its own that
    points into the same file: loading stays a per-parameter view of the mapping, with no copy.
    The fused tensors' shape and dtype are checked here, so errors name the checkpoint's own keys.
    """
    fused = [name for name in entries if name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj"))]
    if not fused:
        return entries
    entries = dict(entries)
    E, I, C = config.num_experts, config.moe_intermediate_size, config.hidden_size
    for name in fused:
        entry = entries.pop(name)
        prefix, _, kind = name.rpartition(".")  # "model.layers.N.mlp.experts", "gate_up_proj" | "down_proj"
        expected = (E, 2 * I, C) if kind == "gate_up_proj" else (E, C, I)
        if entry.shape != expected or entry.dtype != config.dtype:
            raise CheckpointError(
                f"{printable(entry.file)}: tensor {printable(name)} is {entry.dtype} {list(entry.shape)} but config.json implies "
                f"{config.dtype} {list(expected)}; the config and the weights are from different models"
            )
        parts = ["gate_proj", "up_proj"] if kind == "gate_up_proj" else ["down_proj"]
        part_shape = (I, C) if kind == "gate_up_proj" else (C, I)
        for e in range(E):
            for j, part in enumerate(parts):
                key = f"{prefix}.{e}.{part}.weight"
                if key in entries:
                    raise CheckpointError(f"{printable(entry.file)}: {printable(key)} is stored both on its own and inside {name}")
                rows = (e, slice(j * I, (j + 1) * I)) if kind == "gate_up_proj" else (e,)
                entries[key] = TensorEntry(entry.file, entry.name, entry.dtype, part_shape, entry.shard, rows)
    return entries


def _check_expert_count(entries: dict[str, TensorEntry], config: Qwen3Config) -> None:
    """A checkpoint with more or fewer experts than config.json says, named as such."""
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}.mlp.experts."
        stored = {name[len(prefix) :].split(".")[0] for name in entries if name.startswith(prefix)}
        expected = config.num_experts if config.is_moe_layer(i) else 0
        if stored and len(stored) != expected:
            file = next(entries[name].file for name in entries if name.startswith(prefix))
            raise CheckpointError(
                f"{printable(file)}: layer {i} has {len(stored)} experts but config.json implies {expected} "
                "(num_experts, decoder_sparse_step, mlp_only_layers); the config and the weights are from "
                "different models"
            )


def _check_matches_model(entries: dict[str, TensorEntry], model: Qwen3, config: Qwen3Config) -> None:
    """Every parameter present once with the config's shape and dtype; nothing unexpected."""
    expected = dict(model.named_parameters())  # a tied lm_head appears once, as embed_tokens
    for name, param in expected.items():
        if name not in entries:
            raise CheckpointError(f"checkpoint has no tensor {name}, which config.json implies; wrong or partial files?")
        entry = entries[name]
        if entry.shape != tuple(param.shape):
            raise CheckpointError(
                f"{printable(entry.file)}: tensor {name} has shape {list(entry.shape)} but config.json implies "
                f"{list(param.shape)}; the config and the weights are from different models"
            )
        if entry.dtype != config.dtype:
            raise CheckpointError(
                f"{printable(entry.file)}: tensor {name} is stored as {entry.dtype} but config.json says "
                f"{config.torch_dtype}"
            )
    unexpected = sorted(set(entries) - set(expected) - {"lm_head.weight"})
    if unexpected:
        raise CheckpointError(
            f"{printable(entries[unexpected[0]].file)}: unexpected tensor {printable(unexpected[0])} "
            f"(+{len(unexpected) - 1} more); not a Qwen3 checkpoint matching this config.json"
        )
    if "lm_head.weight" in entries and "lm_head.weight" not in expected:  # tied, but saved anyway
        if entries["lm_head.weight"].shape != entries["model.embed_tokens.weight"].shape:
            raise CheckpointError(f"{printable(entries['lm_head.weight'].file)}: lm_head.weight has the wrong shape")


def headless_entries(entries: dict[str, TensorEntry]) -> dict[str, TensorEntry] | None:
    """An embedding checkpoint's tensors under our parameter names (`model.` prefixed), or None if it is not one."""
    if "embed_tokens.weight" not in entries or "model.embed_tokens.weight" in entries:
        return None
    return {f"model.{name}": entry for name, entry in entries.items()}


def load_tensor(entry: TensorEntry, device, dtype) -> torch.Tensor:
    """One tensor as a view of its mapped shard, then moved/cast (a no-op on CPU in the stored dtype)."""
    tensor = entry.shard.get_tensor(entry.name)
    if entry.rows is not None:
        tensor = tensor[entry.rows]  # a contiguous run of the stored bytes: still a view
    return tensor.to(device=device, dtype=dtype)


INIT_FILLS = ("normal_", "uniform_", "kaiming_uniform_", "trunc_normal_", "ones_", "zeros_", "constant_")


@contextlib.contextmanager
def no_init():
    """nn.init's fills skipped while the meta-device model is built: the loader replaces every parameter,
    and on the meta device the first fill imports torch._dynamo (torch's meta `normal_` is a reference
    implementation behind a dynamo-disabling decorator), ~1.5 s of a ~2 s second start."""
    saved = {name: getattr(nn.init, name) for name in INIT_FILLS}
    for name in INIT_FILLS:
        setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, fill in saved.items():
            setattr(nn.init, name, fill)


def load_model(path, device="cpu", dtype=torch.float32, optimize=None, quantize=None, quantize_group_size=None) -> Qwen3:
    """Build Qwen3 from a checkpoint folder; returns the model in eval mode on `device` in `dtype`.

    optimize: None keeps the checkpoint's layout (the parity suite's reference). After the strict load,
        "decode" lays the model out for one sequence at a time, "batch" for batches (kernels/layout.py);
        either way logits equal the checkpoint layout's up to float rounding.
    quantize: "int8" stores every matrix as int8 with per-row scales computed now (kernels/quantize.py);
        "int4" as int4 with a scale and zero point per group of quantize_group_size weights (kernels/int4.py).
    quantize_group_size: 32 (None: the default, as llama.cpp's Q4_0), 64 or 128; int4 only.
    """
    if optimize not in LAYOUTS:
        raise ValueError(f"optimize={optimize!r}: use one of {LAYOUTS}")
    group_size = check_quantize(quantize, quantize_group_size)
    folder = Path(path)
    if not folder.is_dir():
        raise CheckpointError(f"{printable(folder)}: no such checkpoint folder")
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise CheckpointError(f"dtype {dtype!r} is not supported; use one of {sorted(DTYPES)}")
        dtype = DTYPES[dtype]
    config = Qwen3Config.from_json(folder / "config.json")
    entries = split_fused_experts(read_checkpoint_index(folder), config)
    flat = headless_entries(entries)
    entries = flat if flat is not None else entries
    check_config_matches_tensors(config, entries, folder)
    _check_expert_count(entries, config)
    with torch.device("meta"), no_init():
        model = Qwen3(config, head=flat is None)
    _check_matches_model(entries, model, config)
    if flat is not None:  # no lm_head: nothing to fuse or compile for decoding either
        if quantize is not None:
            raise CheckpointError(f"{printable(folder)} is an embedding checkpoint (no lm_head); --quantize is for "
                                  "generative checkpoints")  # fmt: skip
        return _fill(model, entries, device, dtype).eval()
    tied_head = config.tie_word_embeddings
    if tied_head and "lm_head.weight" in entries:  # tied, but saved anyway: it must equal the embedding
        head, embedding = (load_tensor(entries[name], "cpu", entries[name].dtype)
                           for name in ("lm_head.weight", "model.embed_tokens.weight"))  # fmt: skip
        if not torch.equal(head, embedding):
            raise CheckpointError(
                f"{printable(entries['lm_head.weight'].file)}: lm_head.weight differs from the embedding but "
                "config.json says tie_word_embeddings=true; fix the config"
            )
    _fill(model, entries, device, dtype)
    if tied_head:
        model.lm_head.weight = model.model.embed_tokens.weight
    return optimize_layout(model, optimize, quantize, group_size).eval()


def _fill(model: Qwen3, entries: dict[str, TensorEntry], device, dtype) -> Qwen3:
    """Every parameter of the meta-device model becomes its (checked) tensor; then the RoPE tables."""
    for name, _ in list(model.named_parameters()):
        module_name, _, attr = name.rpartition(".")
        tensor = load_tensor(entries[name], device, dtype)
        setattr(model.get_submodule(module_name), attr, nn.Parameter(tensor, requires_grad=False))
        del tensor  # only the model holds the weights now, so a layout transform frees each one it replaces
    model.build_rope_tables(device, dtype)
    return model


def check_quantize(quantize: str | None, group_size: int | None) -> int:
    """The group size to use, after refusing an unknown scheme or a group size it cannot take."""
    if quantize is not None and quantize not in SCHEMES:
        raise CheckpointError(f"--quantize {quantize!r} is not supported; use one of {', '.join(SCHEMES)}")
    if group_size is not None and quantize != "int4":
        raise CheckpointError(f"--quantize-group-size applies to --quantize int4 only (got --quantize {quantize})")
    if group_size is not None and group_size not in GROUP_SIZES:
        raise CheckpointError(f"--quantize-group-size {group_size} is not supported; use one of "
                              f"{', '.join(map(str, GROUP_SIZES))}")  # fmt: skip
    return group_size or DEFAULT_GROUP_SIZE
