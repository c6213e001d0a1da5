"""Qwen3 from scratch in plain PyTorch.

    from qwen3_scratch import load_model, Pipeline, LLM, SamplingParams, Tokenizer
    model = load_model("weights/tiny-qwen3", device="cpu", dtype="float32")
    logits = model(input_ids)  # (B, T) -> (B, T, V)

The package is one folder per layer, each importing only the layers below it (tests/test_layering.py
keeps it so):

    cli/          the commands: qwen3-generate, qwen3-chat, qwen3-serve
    server/       OpenAI's HTTP API over the engine
    generation/   Pipeline and the simple loops  |  engine/   LLM: continuous batching, paged KV, prefix cache
    text/         tokenizer, chat template, chat parser  |  sampling/   SamplingParams, logits -> token
    checkpoint/   a name or folder -> a ready model (download, strict load, placement)
    kernels/      fast paths swapped in at load (compiled one-row products, int8, oneDNN packing)
    model/        Qwen3's maths: config, RoPE, attention, MLP, MoE, KV cache
    errors.py, files.py   what every layer may use

The names below load on first use, so `import qwen3_scratch` (and the CLI's `--help`, and a Ctrl-C
in its first seconds) does not wait for torch.
"""

import importlib
import warnings

from .errors import CheckpointError, ConfigError, GenerationError, HubError, InputError, Qwen3Error


def _installed_version() -> str:
    """The installed package's version, read when first asked: importlib.metadata scans every installed
    distribution, ~30 ms that each command's start would otherwise pay."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("qwen3-scratch")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "0+unknown"


_LAZY = {
    "load_model": ".checkpoint.weights",
    "Pipeline": ".generation.pipeline",
    "LLM": ".engine.llm",
    "SamplingParams": ".sampling.params",
    "StructuredOutputsParams": ".sampling.structured",
    "Tokenizer": ".text.tokenizer",
    "Qwen3": ".model.qwen3",
    "Qwen3Config": ".model.config",
    "KVCache": ".model.kv_cache",
}

__all__ = [*_LAZY, "Qwen3Error", "ConfigError", "CheckpointError", "HubError", "GenerationError", "InputError",
           "__version__"]  # fmt: skip


def _generation_request(max_new_tokens: int = 256, *, use_cache=None, compile=None, measure_bandwidth=None, **fields):
    """The old `GenerationRequest`: its sampling fields are a SamplingParams (max_new_tokens is max_tokens)."""
    for name, value in (("use_cache", use_cache), ("compile", compile), ("measure_bandwidth", measure_bandwidth)):
        if value is not None:
            raise TypeError(f"{name} is an option of Pipeline.load(..., {name}=...) now, not of a request")
    return __getattr__("SamplingParams")(max_tokens=max_new_tokens, **fields)


# Names of the last release, kept for one more, each warning once where it is first used.
_DEPRECATED = {
    "RequestParams": ("SamplingParams", lambda: __getattr__("SamplingParams")),
    "GenerationRequest": ("SamplingParams(max_tokens=...)", lambda: _generation_request),
}
_warned: set[str] = set()


def __getattr__(name: str):
    if name == "__version__":
        return _installed_version()
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    if name in _DEPRECATED:
        new, value = _DEPRECATED[name]
        if name not in _warned:
            _warned.add(name)
            warnings.warn(f"qwen3_scratch.{name} is deprecated; use qwen3_scratch.{new}", FutureWarning, stacklevel=2)
        return value()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
