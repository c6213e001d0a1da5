"""The published shapes of the dense Qwen3 family, as their config.json files on the Hub give them.

Used to build random checkpoints of the exact shapes (scripts/checkpoints/make_shape_checkpoint.py), to size the
KV cache for every model (the notebook), and by the benchmarks. All share vocab 151936, head_dim 128,
8 kv heads, rope_theta 1e6 and a 40960-token configured context.
"""

COMMON = dict(
    vocab_size=151936,
    head_dim=128,
    num_key_value_heads=8,
    max_position_embeddings=40960,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    bos_token_id=151643,
    eos_token_id=151645,
)

QWEN3_SIZES = {
    # name: (hidden, layers, query heads, intermediate, tied embeddings, shards on the Hub)
    "0.6B": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, intermediate_size=3072, tie_word_embeddings=True),
    "1.7B": dict(hidden_size=2048, num_hidden_layers=28, num_attention_heads=16, intermediate_size=6144, tie_word_embeddings=True),
    "4B": dict(hidden_size=2560, num_hidden_layers=36, num_attention_heads=32, intermediate_size=9728, tie_word_embeddings=True),
    "8B": dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, intermediate_size=12288, tie_word_embeddings=False),
    "14B": dict(hidden_size=5120, num_hidden_layers=40, num_attention_heads=40, intermediate_size=17408, tie_word_embeddings=False),
    "32B": dict(hidden_size=5120, num_hidden_layers=64, num_attention_heads=64, intermediate_size=25600, tie_word_embeddings=False),
}


def config_dict(size: str) -> dict:
    """A Hub-layout config.json (as a dict) for one Qwen3 size."""
    if size not in QWEN3_SIZES:
        raise ValueError(f"unknown Qwen3 size {size!r}; choose one of {', '.join(QWEN3_SIZES)}")
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "attention_bias": False,
        "hidden_act": "silu",
        "rope_scaling": None,
        "torch_dtype": "bfloat16",
        "use_sliding_window": False,
        "sliding_window": None,
        **COMMON,
        **QWEN3_SIZES[size],
    }


def parameter_count(size: str) -> int:
    """Parameters of one Qwen3 size (a tied lm_head counted once)."""
    c = config_dict(size)
    C, F, V, D = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["head_dim"]
    H, K = c["num_attention_heads"], c["num_key_value_heads"]
    attention = C * H * D + 2 * C * K * D + H * D * C + 2 * D  # q, k, v, o and the q/k norms
    per_layer = attention + 3 * C * F + 2 * C  # SwiGLU and two RMSNorms
    head = 0 if c["tie_word_embeddings"] else V * C
    return V * C + c["num_hidden_layers"] * per_layer + C + head


# The mixture-of-experts models (model_type qwen3_moe): 4 kv heads instead of 8, untied embeddings, and in
# every layer 128 expert SwiGLUs of width moe_intermediate_size, 8 of them used per token. Their
# intermediate_size would only size a dense layer (mlp_only_layers), which neither model has.
QWEN3_MOE_SIZES = {
    "30B-A3B": dict(hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, intermediate_size=6144, moe_intermediate_size=768),
    "235B-A22B": dict(hidden_size=4096, num_hidden_layers=94, num_attention_heads=64, intermediate_size=12288, moe_intermediate_size=1536),
}


def moe_config_dict(size: str) -> dict:
    """A Hub-layout config.json (as a dict) for one Qwen3-MoE size."""
    if size not in QWEN3_MOE_SIZES:
        raise ValueError(f"unknown Qwen3-MoE size {size!r}; choose one of {', '.join(QWEN3_MOE_SIZES)}")
    return {
        **config_dict("8B"),  # the dense keys (rope, dtype, ids), overwritten below
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "num_key_value_heads": 4,
        "tie_word_embeddings": False,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        **QWEN3_MOE_SIZES[size],
    }


def moe_parameter_counts(config: dict) -> tuple[int, int]:
    """(total, active per token) parameters of a qwen3_moe config.json dict.

    Active counts what one token runs through: attention, the router and k of E experts in MoE layers,
    the dense MLP elsewhere, both embedding matrices (the lookup touches one row; lm_head reads all).
    """
    C, V, D = config["hidden_size"], config["vocab_size"], config["head_dim"]
    H, K = config["num_attention_heads"], config["num_key_value_heads"]
    E, k = config["num_experts"], config["num_experts_per_tok"]
    step, dense_layers = config.get("decoder_sparse_step", 1), config.get("mlp_only_layers", [])
    attention = C * H * D + 2 * C * K * D + H * D * C + 2 * D + 2 * C  # q, k, v, o, q/k norms, two RMSNorms
    expert = 3 * C * config["moe_intermediate_size"]
    total = active = V * C * (1 if config["tie_word_embeddings"] else 2) + C  # embeddings, lm_head, final norm
    for i in range(config["num_hidden_layers"]):
        if i not in dense_layers and (i + 1) % step == 0:
            total += attention + C * E + E * expert
            active += attention + C * E + k * expert
        else:
            total += attention + 3 * C * config["intermediate_size"]
            active += attention + 3 * C * config["intermediate_size"]
    return total, active


def per_rank_bytes(config: dict, n: int, bytes_per_value: int = 2) -> tuple[int, int] | None:
    """(weight bytes, KV-cache bytes per token) that one of n tensor-parallel ranks holds, or None when n
    cannot split the model (parallel/plan.py's rule: n divides the query heads, the MLP width and the
    experts; n divides the kv heads or they divide n, each then replicated n/K times).

    The split is parallel/plan.py's: q/k/v/o and the MLPs by heads and width, embedding and lm_head by
    vocabulary rows (V/n rounded up), whole experts per rank, the norms and the MoE router replicated.
    """
    C, V, D, L = config["hidden_size"], config["vocab_size"], config["head_dim"], config["num_hidden_layers"]
    H, K, E = config["num_attention_heads"], config["num_key_value_heads"], config.get("num_experts", 0)
    F = config["intermediate_size"]
    if H % n or (K % n if K >= n else n % K) or (E and E % n) or (not E and F % n):
        return None
    kv_heads = max(1, K // n)
    attention = 2 * C * (H // n) * D + 2 * C * kv_heads * D + 2 * D + 2 * C  # q, o, k, v, q/k norms, two RMSNorms
    mlp = C * E + (E // n) * 3 * C * config["moe_intermediate_size"] if E else 3 * C * (F // n)
    vocab_rows = -(-V // n)
    embeddings = vocab_rows * C * (1 if config["tie_word_embeddings"] else 2)
    weights = embeddings + L * (attention + mlp) + C
    return weights * bytes_per_value, 2 * L * kv_heads * D * bytes_per_value


def all_sizes() -> dict[str, dict]:
    """Every published Qwen3 config.json (as a dict), dense then MoE."""
    return {**{s: config_dict(s) for s in QWEN3_SIZES}, **{s: moe_config_dict(s) for s in QWEN3_MOE_SIZES}}
