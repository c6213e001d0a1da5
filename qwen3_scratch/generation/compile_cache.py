"""What `--compile` asks inductor for, and where its compiled code is kept between runs.

An inductor compile of the decode step took 42 s on the 0.6B shapes and 66 s at 8B on an H100. Almost all
of it is code generation and tuning that gives the same kernels every time for the same graph, torch and
GPU, so inductor keeps it on disk: its FX graph cache (the generated code per graph) and AOT autograd's
cache (the traced graph). They live in TORCHINDUCTOR_CACHE_DIR, /tmp/torchinductor_<user> by default, which
a reboot or a fresh container empties; we point it at a folder that stays, ~/.cache/qwen3-scratch/inductor
(unless the user set one), so a second start of `--compile` spends its time tracing, not compiling.
"""

import os
from pathlib import Path

import torch

CACHE_DIR = Path.home() / ".cache" / "qwen3-scratch" / "inductor"


def use_disk_cache() -> None:
    """Keep inductor's compiled code in CACHE_DIR (or the user's TORCHINDUCTOR_CACHE_DIR) across runs."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(CACHE_DIR))  # read by inductor when it first writes
    torch._inductor.config.fx_graph_cache = True
    torch._functorch.config.enable_autograd_cache = True


def compile_options(model: torch.nn.Module, cuda: bool) -> dict:
    """inductor's options for the decode step: CUDA graphs on a GPU ("reduce-overhead").

    With int8 weights, also gpt-fast's coordinate-descent tuning: with it (and only with it) inductor turns
    a one-row product into a reduction of its own (torch/_inductor/decomposition.py, `mm`), into which the
    int8 -> bf16 cast of the weights fuses, so each int8 weight is read once (one byte) per step. Without
    it the product stays a cuBLAS call fed by a bf16 copy of the matrix, written and read at every step.
    """
    use_disk_cache()
    options = {"triton.cudagraphs": True} if cuda else {}
    if cuda and any(getattr(m, "scheme", None) == "int8" for m in model.modules()):
        options["coordinate_descent_tuning"] = True
    return options
