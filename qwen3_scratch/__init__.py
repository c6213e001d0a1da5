"""Qwen3 from scratch in plain PyTorch.

    from qwen3_scratch import load_model
    model = load_model("weights/Qwen3-0.6B", device="cuda", dtype="bfloat16")
    logits = model(input_ids)  # (B, T) -> (B, T, V)
"""

from .config import Qwen3Config
from .errors import CheckpointError, ConfigError, GenerationError, HubError, Qwen3Error
from .kv_cache import KVCache
from .model import Qwen3
from .weights import load_model

__all__ = [
    "Qwen3Config",
    "Qwen3",
    "KVCache",
    "load_model",
    "Qwen3Error",
    "ConfigError",
    "CheckpointError",
    "HubError",
    "GenerationError",
]
