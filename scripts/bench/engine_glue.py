"""A CPU engine's decode step with its layers' glue eager against the stored any-length kernels, in one process.

    python scripts/bench/engine_glue.py                                   # 0.6B shapes, bf16, 4/8/16/32 rows x 256
    python scripts/bench/engine_glue.py --rows 16 --context 512 --steps 21

The engine's "batch" layout runs four kernels a layer between its products (kernels/gpu_decode.py: norm, q/k
norm + RoPE, residual + norm, SwiGLU), stored as AOTInductor packages for any token count. This loads the model
three times: one copy's layers run those packages (built here first if the cache has none: ~40 s, once), one the
eager ops they replace (what stored kernels off, QWEN3_SCRATCH_AOT=0, runs), one torch.compile's kernels (what a
first start runs until the packages are stored). Then, for each row count, the three engines take the same decode
step (every row at --context cached tokens, the pool in place), alternating, and the medians are printed, with
whether the packages gave the eager ops' logits.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
for path in (ROOT, ROOT / "scripts" / "bench"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from machine import Table, machine, machine_line  # noqa: E402
from profile_serving_step import decode_chunks  # noqa: E402

from qwen3_scratch.checkpoint.weights import load_model  # noqa: E402
from qwen3_scratch.engine.engine import LLMEngine  # noqa: E402
from qwen3_scratch.kernels import aot, aot_build, gpu_decode  # noqa: E402

GLUE = (gpu_decode.norm, gpu_decode.heads, gpu_decode.residual_norm, gpu_decode.swiglu)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="A CPU engine's decode step: eager glue against the stored kernels.")
    p.add_argument("--checkpoint", default=str(ROOT / "weights" / "qwen3-0.6b-shapes"))
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--rows", default="4,8,16,32", help="comma-separated decode rows a step")
    p.add_argument("--context", type=int, default=256, help="cached tokens of every row")
    p.add_argument("--steps", type=int, default=15, help="timed steps per engine, alternating")
    return p.parse_args(argv)


def stored_model(checkpoint: str, dtype: torch.dtype):
    """The model whose layers run the stored glue: built into the cache first where it has none."""
    model = load_model(checkpoint, dtype=dtype, optimize="batch")  # compiles what is not stored, and remembers it
    pending = [key for key in aot.PENDING.values() if ".gpu_decode:" in key["function"]]
    if pending:
        print(f"[packaging the {len(pending)} glue kernels once, into {aot.cache_root()}]", flush=True)
        assert all(aot_build.build(key) for key in pending), "a glue package differs from its compiled kernel"
        gpu_decode._stored.cache_clear()
        model = load_model(checkpoint, dtype=dtype, optimize="batch")
    return model


def glue_model(checkpoint: str, dtype: torch.dtype, compiled: bool):
    """The model whose layers run the glue's eager ops (what stored kernels off runs), or torch.compile's kernels
    for any token count (what a first start runs until the packages are stored)."""
    model = load_model(checkpoint, dtype=dtype, optimize="batch")
    for layer in model.model.layers:
        runs = {fn: gpu_decode.any_length_kernel(fn) if compiled else fn for fn in GLUE}
        layer.__dict__["_glue"] = {fn: bound(run, fn, layer) for fn, run in runs.items()}
    return model


def bound(run, fn, layer):
    attn, eps = layer.self_attn, layer.input_layernorm.eps
    constants = {gpu_decode.heads: dict(n_heads=attn.n_heads, n_kv_heads=attn.n_kv_heads, head_dim=attn.head_dim, eps=eps),
                 gpu_decode.swiglu: {}}.get(fn, {"eps": eps})  # fmt: skip
    return lambda *args: run(*args, **constants)


def main(argv=None):
    args = parse_args(argv)
    torch.set_grad_enabled(False)
    if not aot.enabled():
        sys.exit("engine_glue.py: stored kernels are off (QWEN3_SCRATCH_AOT=0); unset it to compare them")
    dtype = getattr(torch, args.dtype)
    models = {"eager": glue_model(args.checkpoint, dtype, compiled=False), "stored": stored_model(args.checkpoint, dtype),
              "compiled": glue_model(args.checkpoint, dtype, compiled=True)}  # fmt: skip
    print(machine_line(machine()))
    table = Table("rows", "context", "eager glue, ms a step", "stored glue, ms a step", "stored / eager",
                  "compiled glue (a first start), ms a step", "stored and eager: same logits")  # fmt: skip
    S = args.context
    for B in [int(n) for n in args.rows.split(",")]:
        g = torch.Generator().manual_seed(B)
        V = models["eager"].config.vocab_size
        prompts = [torch.randint(0, V, (S + 1,), generator=g).tolist() for _ in range(B)]
        steps, logits = {}, {}
        for name, model in models.items():
            engine = LLMEngine(model, None, [], num_blocks=B * (S // 16 + 2), block_size=16)
            chunks = decode_chunks(engine, prompts, S)
            steps[name] = lambda engine=engine, chunks=chunks: engine.runner.decode(chunks)
            logits[name] = steps[name]()
            steps[name]()  # warm: oneDNN's kernels for these shapes
        times = {name: [] for name in steps}
        for _ in range(args.steps):
            for name, step in steps.items():
                start = time.perf_counter()
                step()
                times[name].append(time.perf_counter() - start)
        eager_ms, stored_ms, compiled_ms = (statistics.median(times[name]) * 1e3 for name in models)
        same = torch.equal(logits["eager"], logits["stored"])
        table.row(B, S, f"{eager_ms:.1f}", f"{stored_ms:.1f}", f"{stored_ms / eager_ms:.3f}", f"{compiled_ms:.1f}",
                  "yes" if same else "no")  # fmt: skip


if __name__ == "__main__":
    main()
