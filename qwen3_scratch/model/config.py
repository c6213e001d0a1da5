"""The model's shape and hyper-parameters, read from the checkpoint's own `config.json`.

Two layouts of config.json exist in the wild and both are accepted:
  - the Hub's Qwen3 repos (written by transformers 4.x): `rope_theta`, `rope_scaling`, `torch_dtype`;
  - transformers 5: `rope_parameters` (holding `rope_theta` and the rope type), `dtype`.
Anything we do not implement (another model type, another RoPE scaling, sliding-window attention)
is refused with a ConfigError rather than silently building a different model.
"""

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from qwen3_scratch.errors import ConfigError, printable
from qwen3_scratch.files import read_json

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Rule:
    """What one config field may hold. config.json is downloaded, so every value is checked before use."""

    kind: str  # "int" (a JSON integer; not true/false, not "64", not 64.0), "number" (int or float), "bool"
    low: float = -math.inf
    high: float = math.inf
    above_low: bool = False  # the value must be > low, not >= low

    def allows(self, value) -> bool:
        if self.kind == "bool":
            return isinstance(value, bool)
        kinds = int if self.kind == "int" else (int, float)
        if not isinstance(value, kinds) or isinstance(value, bool) or not math.isfinite(value):
            return False
        return (value > self.low if self.above_low else value >= self.low) and value <= self.high

    def describe(self) -> str:
        if self.kind == "bool":
            return "true or false"
        noun = "an integer" if self.kind == "int" else "a finite number"
        low = f"> {self.low:g}" if self.above_low else f">= {self.low:g}"
        return f"{noun} {low} and <= {self.high:g}"


def check_rules(obj, rules: dict[str, Rule]) -> None:
    """Raise ConfigError for the first field of `obj` its rule does not allow."""
    for name, rule in rules.items():
        value = getattr(obj, name)
        if not rule.allows(value):
            raise ConfigError(f"{name} must be {rule.describe()}, got {printable(repr(value), 80)}; "
                              "fix config.json or download it again")  # fmt: skip


# Bounds are generous: the largest Qwen3 (235B-A22B: 94 layers, hidden 4096, 64 heads, vocab 151936)
# and 1M-token YaRN configs fit with room to spare. A value beyond them is a broken or hostile file,
# and refusing it here keeps it from deciding any allocation. A new field gets a line here (a test
# checks that every field has one).
POSITIVE_INT = Rule("int", 1, 2**20)
CONFIG_RULES = {
    "vocab_size": Rule("int", 1, 2**24),
    "hidden_size": Rule("int", 1, 2**17),
    "intermediate_size": Rule("int", 1, 2**20),
    "num_hidden_layers": Rule("int", 1, 4096),
    "num_attention_heads": Rule("int", 1, 4096),
    "num_key_value_heads": Rule("int", 1, 4096),
    "head_dim": Rule("int", 2, 4096),
    "max_position_embeddings": Rule("int", 1, 2**24),  # 16M positions; the RoPE tables grow on demand
    # base <= 1 would make every channel turn at least as fast as the first, and YaRN divides by log(base)
    "rope_theta": Rule("number", 1, 1e15, above_low=True),
    "rms_norm_eps": Rule("number", 0, 1, above_low=True),  # 0 divides by zero on an all-zero row
    "tie_word_embeddings": Rule("bool"),
    "attention_bias": Rule("bool"),
    # MoE (0 = dense); _check_moe_fields then asks more of a qwen3_moe config (>= 1, k <= E, ...)
    "num_experts": Rule("int", 0, 4096),  # 235B-A22B: 128
    "num_experts_per_tok": Rule("int", 0, 4096),
    "moe_intermediate_size": Rule("int", 0, 2**20),
    "norm_topk_prob": Rule("bool"),
    "decoder_sparse_step": Rule("int", 0, 4096),
}
YARN_RULES = {
    "factor": Rule("number", 1, 1024),
    "original_max_position_embeddings": Rule("int", 1, 2**24),
    "beta_fast": Rule("number", 0, 1e4, above_low=True),
    "beta_slow": Rule("number", 0, 1e4, above_low=True),
    "truncate": Rule("bool"),
}
YARN_ATTENTION_FACTOR = Rule("number", 0, 1e4, above_low=True)  # or null: 0.1 * ln(factor) + 1
# Fields checked by hand in __post_init__, because their rule depends on another field or is not a number.
SPECIAL_FIELDS = {"rope_scaling", "torch_dtype", "eos_token_ids", "bos_token_id", "mlp_only_layers"}


@dataclass
class RopeScaling:
    """YaRN: stretch RoPE to `factor` x the context the model was trained on (Qwen's long-context setting)."""

    factor: float  # how much longer than the training context, e.g. 4.0 for 32k -> 128k
    original_max_position_embeddings: int  # the context length used in pre-training
    beta_fast: float = 32.0  # dims rotating more than this many times in the original context keep their frequency
    beta_slow: float = 1.0  # dims rotating fewer times than this are fully interpolated
    attention_factor: float | None = None  # scales cos/sin; None -> 0.1 * ln(factor) + 1, as the paper suggests
    truncate: bool = True  # round the ramp's bounds to whole dims, as transformers does

    def __post_init__(self):
        check_rules(self, YARN_RULES)
        if self.attention_factor is not None and not YARN_ATTENTION_FACTOR.allows(self.attention_factor):
            raise ConfigError(f"yarn attention_factor must be null or {YARN_ATTENTION_FACTOR.describe()}, "
                              f"got {printable(repr(self.attention_factor), 80)}")  # fmt: skip
        self.factor, self.beta_fast, self.beta_slow = float(self.factor), float(self.beta_fast), float(self.beta_slow)


@dataclass
class Qwen3Config:
    vocab_size: int = 151936  # V: rows of the embedding table
    hidden_size: int = 1024  # C: width of the residual stream
    intermediate_size: int = 3072  # width of the SwiGLU MLP
    num_hidden_layers: int = 28  # L: decoder blocks
    num_attention_heads: int = 16  # H: query heads
    num_key_value_heads: int = 8  # K: key/value heads; H // K query heads share each (GQA)
    head_dim: int = 128  # D: its own field; Qwen3 does not use hidden_size // heads (1024 / 16 = 64 != 128)
    max_position_embeddings: int = 40960  # the longest sequence the model is configured for
    rope_theta: float = 1_000_000.0  # RoPE base: larger -> slower-rotating low frequencies
    rope_scaling: RopeScaling | None = None  # None: plain RoPE; else YaRN
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True  # lm_head reuses embed_tokens' matrix (the small models)
    attention_bias: bool = False  # Qwen3 has no biases in q/k/v/o (Qwen2 had them)
    torch_dtype: str = "bfloat16"  # the dtype the checkpoint is stored in
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    # Mixture of experts (model_type qwen3_moe); num_experts 0 means a dense Qwen3.
    num_experts: int = 0  # E: expert MLPs per MoE layer (30B-A3B: 128)
    num_experts_per_tok: int = 0  # k: experts each token is routed to (30B-A3B: 8)
    moe_intermediate_size: int = 0  # width of each expert's SwiGLU (30B-A3B: 768)
    norm_topk_prob: bool = False  # rescale the k chosen router probabilities to sum to 1
    decoder_sparse_step: int = 1  # every step-th layer (1-based) is MoE; the others keep a dense MLP
    mlp_only_layers: list[int] = field(default_factory=list)  # layer indices forced to a dense MLP

    def is_moe_layer(self, layer_index: int) -> bool:
        """Whether layer `layer_index` (0-based) has the sparse MoE block, by transformers' rule."""
        return (
            self.num_experts > 0
            and layer_index not in self.mlp_only_layers
            and (layer_index + 1) % self.decoder_sparse_step == 0
        )

    @property
    def kv_groups(self) -> int:
        """Query heads per key/value head."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.torch_dtype]

    def __post_init__(self):
        check_rules(self, CONFIG_RULES)
        self.rope_theta, self.rms_norm_eps = float(self.rope_theta), float(self.rms_norm_eps)
        for name, token_id in [("bos_token_id", self.bos_token_id)] + [("eos_token_id", i) for i in self.eos_token_ids]:
            if token_id is not None and not Rule("int", 0, self.vocab_size - 1).allows(token_id):
                raise ConfigError(f"{name} must be a token id in [0, vocab_size={self.vocab_size}), got "
                                  f"{printable(repr(token_id), 80)}; fix config.json")  # fmt: skip
        if not isinstance(self.torch_dtype, str) or self.torch_dtype not in DTYPES:
            raise ConfigError(f"dtype {printable(repr(self.torch_dtype), 80)} is not supported; "
                              f"expected one of {sorted(DTYPES)}")  # fmt: skip
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")
        _check_moe_fields(self)

    @classmethod
    def from_json(cls, path) -> "Qwen3Config":
        path = Path(path)
        if path.is_dir() and path.name != "config.json":  # a folder; a folder *named* config.json is refused below
            path = path / "config.json"
        if not path.exists():
            raise ConfigError(f"{printable(path)}: not found; a checkpoint folder needs the config.json "
                              "it was saved with")  # fmt: skip
        return cls.from_dict(read_json(path, ConfigError), source=printable(path))

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> "Qwen3Config":
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: expected a JSON object, found {type(raw).__name__}")
        if raw.get("model_type") not in ("qwen3", "qwen3_moe"):
            raise ConfigError(
                f"{source}: model_type is {printable(repr(raw.get('model_type')), 80)}; qwen3-scratch implements "
                "only 'qwen3' (dense Qwen3, 0.6B to 32B) and 'qwen3_moe' (30B-A3B, 235B-A22B)"
            )
        if raw.get("use_sliding_window"):
            raise ConfigError(f"{source}: use_sliding_window=true is not implemented; Qwen3 ships it false")
        try:
            rope_theta, rope_scaling = _read_rope(raw)
            config = cls(
                vocab_size=raw["vocab_size"],
                hidden_size=raw["hidden_size"],
                intermediate_size=raw["intermediate_size"],
                num_hidden_layers=raw["num_hidden_layers"],
                num_attention_heads=raw["num_attention_heads"],
                num_key_value_heads=_given(raw, "num_key_value_heads", raw["num_attention_heads"]),
                head_dim=raw["head_dim"] if raw.get("head_dim") is not None else _derived_head_dim(raw),
                max_position_embeddings=raw["max_position_embeddings"],
                rope_theta=rope_theta,
                rope_scaling=rope_scaling,
                rms_norm_eps=_given(raw, "rms_norm_eps", 1e-6),
                tie_word_embeddings=_given(raw, "tie_word_embeddings", False),
                attention_bias=_given(raw, "attention_bias", False),
                torch_dtype=_read_dtype(raw),
                eos_token_ids=_id_list(raw.get("eos_token_id")),
                bos_token_id=raw.get("bos_token_id"),
                **_read_moe(raw),
            )
        except KeyError as e:
            raise ConfigError(f"{source}: missing key {e.args[0]!r}; is this a Qwen3 config.json?") from e
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from e
        hidden_act = raw.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise ConfigError(f"{source}: hidden_act {printable(repr(hidden_act), 80)} is not implemented; "
                              "Qwen3 uses 'silu'")  # fmt: skip
        return config


def _given(raw: dict, key: str, default):
    """raw[key], or `default` when the key is missing or null (0 or false are values, and get checked)."""
    value = raw.get(key)
    return default if value is None else value


def _derived_head_dim(raw: dict) -> int:
    """Older configs leave head_dim out: hidden_size // num_attention_heads, once both are known to be sane."""
    hidden, heads = raw["hidden_size"], raw["num_attention_heads"]
    if not (CONFIG_RULES["hidden_size"].allows(hidden) and CONFIG_RULES["num_attention_heads"].allows(heads)):
        return None  # __post_init__ names the bad field
    return hidden // heads or None


def _id_list(value) -> list:
    """eos_token_id as a list: one id, a list of ids, or null (checked against the vocabulary later)."""
    if value is None:
        return []
    return list(value) if isinstance(value, list) else [value]


def _read_moe(raw: dict) -> dict:
    """The qwen3_moe fields (none for a dense qwen3 config).

    transformers 5 writes num_experts as `num_local_experts`. The router-loss settings
    (output_router_logits, router_aux_loss_coef) only matter for training and are ignored.
    """
    if raw.get("model_type") != "qwen3_moe":
        return {}
    for key in ("shared_expert_intermediate_size", "moe_layer_freq", "first_k_dense_replace"):
        if raw.get(key):  # other MoE families' features, not Qwen3-MoE's
            raise ConfigError(f"{key}={raw[key]!r} is not implemented; Qwen3-MoE has no such setting")
    num_experts = raw.get("num_experts", raw.get("num_local_experts"))
    if num_experts is None:
        raise KeyError("num_experts")
    if num_experts == 0:  # transformers would quietly build a dense model; that is not a Qwen3-MoE checkpoint
        raise ConfigError("num_experts must be an integer >= 1 for model_type qwen3_moe, got 0")
    return dict(
        num_experts=num_experts,
        num_experts_per_tok=raw["num_experts_per_tok"],
        moe_intermediate_size=raw["moe_intermediate_size"],
        norm_topk_prob=raw.get("norm_topk_prob", False),
        decoder_sparse_step=raw.get("decoder_sparse_step", 1),
        mlp_only_layers=raw.get("mlp_only_layers") or [],
    )


def _check_moe_fields(config: Qwen3Config) -> None:
    """Types and ranges of the MoE fields, each error naming its key."""
    if config.num_experts == 0:
        return
    E, L = config.num_experts, config.num_hidden_layers
    for key, value, low, high in [
        ("num_experts", E, 1, None),
        ("num_experts_per_tok", config.num_experts_per_tok, 1, E),
        ("moe_intermediate_size", config.moe_intermediate_size, 1, None),
        ("decoder_sparse_step", config.decoder_sparse_step, 1, None),
    ]:
        if type(value) is not int or value < low or (high is not None and value > high):
            bounds = f"between {low} and {high}" if high is not None else f">= {low}"
            raise ConfigError(f"{key} must be an integer {bounds}, got {value!r}")
    if type(config.norm_topk_prob) is not bool:
        raise ConfigError(f"norm_topk_prob must be true or false, got {config.norm_topk_prob!r}")
    if not isinstance(config.mlp_only_layers, list):
        raise ConfigError(f"mlp_only_layers must be a list of layer indices, got {config.mlp_only_layers!r}")
    bad = [i for i in config.mlp_only_layers if type(i) is not int or not 0 <= i < L]
    if bad:
        raise ConfigError(f"mlp_only_layers must hold layer indices in 0..{L - 1}, got {bad[0]!r}")


def _read_dtype(raw: dict) -> str:
    name = raw.get("dtype") or raw.get("torch_dtype") or "bfloat16"
    if not isinstance(name, str) or name not in DTYPES:
        raise ConfigError(f"dtype {printable(repr(name), 80)} is not supported; expected one of {sorted(DTYPES)}")
    return name


def _read_rope(raw: dict) -> tuple[float, RopeScaling | None]:
    """(rope_theta, yarn settings or None) from either config layout."""
    if "rope_parameters" in raw and raw["rope_parameters"] is not None:  # transformers 5
        params = _rope_dict(raw["rope_parameters"], "rope_parameters")
        theta = params.pop("rope_theta", raw.get("rope_theta", 10_000.0))
    else:  # the Hub's layout
        params = _rope_dict(raw.get("rope_scaling") or {}, "rope_scaling")
        theta = raw.get("rope_theta", 10_000.0)
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "yarn":
        raise ConfigError(f"rope type {printable(repr(rope_type), 80)} is not implemented; "
                          "supported: 'default', 'yarn'")  # fmt: skip
    if "factor" not in params or "original_max_position_embeddings" not in params:
        raise ConfigError("yarn rope scaling needs 'factor' and 'original_max_position_embeddings'")
    if params.get("mscale") or params.get("mscale_all_dim"):
        raise ConfigError("yarn with mscale/mscale_all_dim (DeepSeek style) is not implemented")
    return theta, RopeScaling(
        factor=params["factor"],
        original_max_position_embeddings=params["original_max_position_embeddings"],
        beta_fast=_given(params, "beta_fast", 32.0),
        beta_slow=_given(params, "beta_slow", 1.0),
        attention_factor=params.get("attention_factor"),
        truncate=_given(params, "truncate", True),
    )


def _rope_dict(value, key: str) -> dict:
    if not isinstance(value, dict):
        raise ConfigError(f"{key} must be a JSON object or null, got {printable(repr(value), 80)}")
    return dict(value)
