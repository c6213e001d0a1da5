"""MoE decode speed on CPU: ours vs transformers, side by side in one run, on Qwen3-30B-A3B's per-layer shapes.

    python scripts/bench/benchmark_moe.py                   # 4 layers of 30B-A3B shapes, bf16, 32 new tokens x 5
    python scripts/bench/benchmark_moe.py --dtype float16   # the same weights cast to fp16 by both engines
    python scripts/bench/benchmark_moe.py --layers 6 --new-tokens 64 --repeats 7

The whole 30B-A3B (61 GB in bf16) does not fit this machine, so the checkpoint keeps every per-layer
shape (hidden 2048, 32 query / 4 kv heads, 128 experts of width 768, 8 per token) and the real vocabulary,
with fewer layers: random weights written by scripts/checkpoints/make_shape_checkpoint.py (its weights/ folder is
reused). Decode speed depends on the bytes and matmul sizes, not on what the weights say.

A decode step of one token reads only its 8 experts per layer, so the bandwidth limit is
    measured bandwidth / active bytes per step   (stats.bytes_per_decode_step),
not the whole model's size. The bandwidth is measured in this run, before and after the engines.
The machine may be shared: the engines alternate run by run, so a burst of someone else's load falls
on both, and the medians are reported with the load average at the start and the end.
"""

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
for folder in (ROOT, HERE, ROOT / "scripts" / "checkpoints"):  # run as a script from anywhere
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

from benchmark_decode import load_transformers, random_prompt, time_ours, time_transformers  # noqa: E402
from machine import Table, machine, machine_line  # noqa: E402
from make_shape_checkpoint import make_shape_checkpoint  # noqa: E402

from qwen3_scratch.checkpoint.weights import load_model  # noqa: E402
from qwen3_scratch.generation.stats import _BANDWIDTH_CACHE, bytes_per_decode_step, measure_bandwidth, weight_bytes  # noqa: E402

SIZE = "30B-A3B"
ENGINES = ("transformers", "ours")


def checkpoint(layers: int) -> Path:
    path = ROOT / "weights" / f"qwen3-30b-a3b-{layers}layers-shapes"
    print(f"checkpoint: {path} (written if missing or incomplete)", flush=True)
    return make_shape_checkpoint(SIZE, path, overrides={"num_hidden_layers": layers})


def bandwidth_now() -> float:
    _BANDWIDTH_CACHE.clear()  # measure again, not the cached figure
    return measure_bandwidth("cpu")


def run(engine: str, models: dict, prompt: list[int], n: int):
    if engine == "transformers":
        return time_transformers(models[engine], prompt, n, "cpu")
    return time_ours(models[engine], prompt, n, "cpu", use_cache=True)


def alternate(models: dict, prompt: list[int], n: int, repeats: int) -> dict[str, list]:
    """One untimed warm-up each, then transformers, ours, transformers, ours, ..."""
    for engine in ENGINES:
        run(engine, models, prompt, min(n, 8))
    runs = {engine: [] for engine in ENGINES}
    for i in range(repeats):
        for engine in ENGINES:
            runs[engine].append(run(engine, models, prompt, n))
            r = runs[engine][-1]
            print(f"  run {i + 1}/{repeats} {engine:>12}: ttft {r.ttft_s:.3f} s, decode {r.decode_tok_s:.2f} tok/s",
                  flush=True)  # fmt: skip
    return runs


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="MoE decode on CPU: ours vs transformers on 30B-A3B per-layer shapes.")
    p.add_argument("--layers", type=int, default=4, help="decoder layers of 30B-A3B shape (the real model has 48)")
    p.add_argument("--new-tokens", type=int, default=32, help="greedy tokens per run (default 32)")
    p.add_argument("--prompt-tokens", type=int, default=32, help="random prompt length (default 32)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per engine, alternating (default 5)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"],
                   help="bfloat16 (stored; ours runs on the mapped file) or float16 (both engines cast once)")
    p.add_argument("--out", default="docs/benchmarks", help="folder for cpu_30B-A3B-<layers>layers_<dtype>_moe.json")
    args = p.parse_args(argv)
    torch.set_grad_enabled(False)
    load_start = os.getloadavg()
    bandwidth_before = bandwidth_now()
    path = checkpoint(args.layers)
    dtype = getattr(torch, args.dtype)
    models = {"transformers": load_transformers(path, "cpu", dtype), "ours": load_model(path, "cpu", dtype)}
    ours = models["ours"]
    prompt = random_prompt(args.prompt_tokens, ours.config.vocab_size)
    mean_context = args.prompt_tokens + args.new_tokens // 2
    active = bytes_per_decode_step(ours, ours.config, mean_context, 1)
    runs = alternate(models, prompt, args.new_tokens, args.repeats)
    bandwidth = max(bandwidth_before, bandwidth_now())  # the less disturbed of the two measurements
    limit = bandwidth / active
    info = {**machine("cpu", bandwidth), "load_average_start": load_start, "load_average_end": os.getloadavg()}
    same = runs["ours"][-1].tokens == runs["transformers"][-1].tokens
    print("\n" + machine_line(info))
    print("command: python scripts/bench/benchmark_moe.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    print(f"\nQwen3-{SIZE} shapes, {args.layers} layers, {args.dtype}: {weight_bytes(ours) / 1e9:.2f} GB of weights, "
          f"{active / 1e9:.3f} GB read per decode step (8 of 128 experts, lm_head, KV at context {mean_context}); "
          f"bandwidth {bandwidth / 1e9:.1f} GB/s -> limit {limit:.1f} tok/s; median of {args.repeats} alternating runs\n")
    table = Table("engine", "TTFT (s)", "decode tok/s", "% of the active-bytes limit", "all runs (tok/s)")
    report = {}
    for engine in ENGINES:
        decode = statistics.median(r.decode_tok_s for r in runs[engine])
        ttft = statistics.median(r.ttft_s for r in runs[engine])
        every = [round(r.decode_tok_s, 2) for r in runs[engine]]
        report[engine] = {"ttft_s": ttft, "decode_tok_s": decode, "util": decode / limit, "decode_tok_s_all": every}
        table.row(engine, f"{ttft:.3f}", f"{decode:.2f}", f"{decode / limit:.0%}", every)
    print(f"\ngreedy tokens identical to transformers': {same}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {"machine": info, "args": vars(args), "active_bytes_per_step": active, "weight_bytes": weight_bytes(ours),
              "limit_tok_s": limit, "greedy_tokens_identical": same, "engines": report}  # fmt: skip
    file = out / f"cpu_{SIZE}-{args.layers}layers_{args.dtype}_moe.json"
    file.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {file}")


if __name__ == "__main__":
    main()
