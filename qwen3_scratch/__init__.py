"""Qwen3 from scratch in plain PyTorch.

    from qwen3_scratch import load_model
    model = load_model("weights/tiny-qwen3", device="cpu", dtype="float32")
    logits = model(input_ids)  # (B, T) -> (B, T, V)

The names below load on first use, so `import qwen3_scratch` (and the CLI's `--help`, and a Ctrl-C
in its first seconds) does not wait for torch.
"""

import importlib
from importlib.metadata import PackageNotFoundError, version

from .errors import CheckpointError, ConfigError, GenerationError, HubError, InputError, Qwen3Error

try:
    __version__ = version("qwen3-scratch")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"

_LAZY = {"Qwen3Config": ".config", "Qwen3": ".model", "KVCache": ".kv_cache", "load_model": ".weights"}

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
    "InputError",
    "__version__",
]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
