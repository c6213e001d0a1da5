"""`scripts/bench/benchmark_decode.py --table`: every engine x dtype in its own process, alternating, median of rounds.

    python scripts/bench/benchmark_decode.py --table --engines transformers,plain,cache,int8,llamacpp --repeats 3

One process per (engine, dtype) and per round, as a user picking an engine would run it: each loads
its own model, warms up once, times one run, and reports decode tok/s, the time to its first token (the
prompt's forward: `--prompt-tokens 300` measures prompt speed) and its peak RSS. The rounds
alternate the engines (the order rotates every round), so a busy neighbour slows all of them alike,
and the memory bandwidth is measured in this process before every round; the table divides by the
median. Columns: float32 and bfloat16 run every engine; int8 runs ours (`int8`: int8 weights, bf16
activations) and llama.cpp's Q8_0; int4 ours (`int4`: int4 weights, group 32, bf16 activations) and
llama.cpp's Q4_0. The report names the CPU and the flags its kernels care about (machine.cpu_info).
"""

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from machine import machine

HERE = Path(__file__).resolve().parent
NAMES = {"transformers": "transformers `generate`", "plain": "ours, KV cache, checkpoint layout",
         "packed": "ours, KV cache, fused + prepacked (serving's layout)",
         "cache": "ours, KV cache, compiled matvec (the default)", "int8": "ours, int8 weights",
         "int4": "ours, int4 weights (group 32)",
         "recompute": "ours, full recompute", "llamacpp": "llama.cpp (llama-cpp-python)"}  # fmt: skip


QUANTIZED = ("int8", "int4")  # a column of its own each: our engine of that name and llama.cpp's Q8_0 / Q4_0


def cells(engines: list[str], dtypes: list[str]) -> list[tuple[str, str]]:
    out = []
    for dtype in dtypes:
        for engine in engines:
            if dtype in QUANTIZED and engine in (dtype, "llamacpp"):
                out.append((engine, dtype))
            elif dtype not in QUANTIZED and engine not in QUANTIZED:
                out.append((engine, dtype))
    return out


def run_cell(engine: str, dtype: str, args, workdir: Path) -> dict | None:
    out = workdir / f"{engine}-{dtype}.json"
    out.unlink(missing_ok=True)
    command = [sys.executable, str(HERE / "benchmark_decode.py"), "--sizes", args.sizes, "--device", "cpu",
               "--dtype", "bfloat16" if dtype in QUANTIZED else dtype, "--engines", engine, "--repeats", "1",
               "--sweep-lengths", "", "--new-tokens", str(args.new_tokens), "--prompt-tokens", str(args.prompt_tokens),
               "--warmup-tokens", str(args.warmup_tokens or 4),
               "--child-json", str(out)] + (["--llamacpp-quant", dtype] if dtype in QUANTIZED and engine == "llamacpp" else []) \
        + (["--checkpoint", args.checkpoint] if args.checkpoint else [])  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0 or not out.exists():
        print(f"  {engine} {dtype}: failed: {(done.stderr or done.stdout).strip().splitlines()[-1:]}", flush=True)
        return None
    report = json.loads(out.read_text())
    result = report["engines"][engine]
    result["peak_rss_mib"], result["bytes_per_step"] = report["peak_rss_mib"], result.get("bytes_per_step", report["bytes_per_step"])
    print(f"  {engine} {dtype}: {result['decode_tok_s']:.2f} tok/s, peak RSS {report['peak_rss_mib']:.0f} MiB", flush=True)
    return result


def fresh_bandwidth() -> float:
    from qwen3_scratch.generation import stats

    stats._BANDWIDTH_CACHE.clear()
    return stats.measure_bandwidth("cpu")


def run_table(args, argv: list[str]) -> None:
    engines = (args.engines or "transformers,plain,cache,int8,int4").split(",")
    dtypes = args.table_dtypes.split(",")
    todo = cells(engines, dtypes)
    results: dict[tuple[str, str], list[dict]] = {cell: [] for cell in todo}
    bandwidths = []
    with tempfile.TemporaryDirectory() as tmp:
        for round_index in range(args.repeats):
            bandwidths.append(fresh_bandwidth())
            print(f"round {round_index + 1}/{args.repeats}: bandwidth {bandwidths[-1] / 1e9:.1f} GB/s", flush=True)
            shift = round_index % len(todo)
            for engine, dtype in todo[shift:] + todo[:shift]:
                if (r := run_cell(engine, dtype, args, Path(tmp))) is not None:
                    results[(engine, dtype)].append(r)
    bandwidth = statistics.median(bandwidths)
    info = machine("cpu", bandwidth)
    report = summarize(results, bandwidth)
    print_report(report, engines, dtypes, info, bandwidths, argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {"machine": info, "bandwidths_gb_s": [round(b / 1e9, 2) for b in bandwidths], "command": argv,
              "cells": {f"{e}/{d}": v for (e, d), v in report.items()}}  # fmt: skip
    (out / f"cpu_{args.sizes}_table.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out / f'cpu_{args.sizes}_table.json'}")


def summarize(results: dict, bandwidth: float) -> dict:
    report = {}
    for (engine, dtype), runs in results.items():
        if not runs:
            continue
        tok_s = statistics.median(r["decode_tok_s"] for r in runs)
        step_bytes = runs[0]["bytes_per_step"]
        report[(engine, dtype)] = {
            "decode_tok_s": tok_s, "all": [round(r["decode_tok_s"], 2) for r in runs],
            "ttft_s": statistics.median(r["ttft_s"] for r in runs),
            "peak_rss_mib": statistics.median(r["peak_rss_mib"] for r in runs),
            "bytes_per_step": step_bytes, "limit_tok_s": bandwidth / step_bytes, "util": tok_s * step_bytes / bandwidth,
            "tokens": runs[-1]["tokens"],
        }  # fmt: skip
    return report


def print_report(report: dict, engines, dtypes, info: dict, bandwidths, argv) -> None:
    print(f"\nCPU: {info['cpu']}, {info['cores']} cores, torch {info['torch']} ({info['torch_threads']} threads), "
          f"transformers {info['transformers']}")
    print(f"CPU flags the kernels care about: {', '.join(info['cpu_flags']) or 'none found'}")
    print(f"bandwidth per round (GB/s): {', '.join(f'{b / 1e9:.1f}' for b in bandwidths)}; median {info['bandwidth_gb_s']}")
    print("command: python scripts/bench/benchmark_decode.py " + " ".join(argv))
    limits = {d: next((v["limit_tok_s"] for (e, dd), v in report.items() if dd == d and e != "llamacpp"), None)
              for d in dtypes}  # fmt: skip
    print("\n| engine | " + " | ".join(f"{d} decode tok/s (% of limit)" for d in dtypes) + " | peak RSS, MiB |")
    print("|---|" + "---:|" * (len(dtypes) + 1))
    print("| bandwidth limit | " + " | ".join(f"{limits[d]:.1f}" if limits[d] else "" for d in dtypes) + " | |")
    for engine in engines:
        row = []
        for d in dtypes:
            v = report.get((engine, d))
            row.append(f"{v['decode_tok_s']:.2f} ({v['util']:.0%})" if v else "–")
        rss = " / ".join(f"{report[(engine, d)]['peak_rss_mib']:.0f}" for d in dtypes if (engine, d) in report)
        print(f"| {NAMES.get(engine, engine)} | " + " | ".join(row) + f" | {rss} |")
    ratios = [ratio(report, d, lambda ours, theirs: ours["decode_tok_s"] / theirs["decode_tok_s"]) for d in dtypes]
    print("| ours / llama.cpp | " + " | ".join(ratios) + " | |")
    print_first_tokens(report, engines, dtypes)
    for (engine, d), v in report.items():
        print(f"  {engine} {d}: runs {v['all']}")


def print_first_tokens(report: dict, engines, dtypes) -> None:
    """The time to the first token of each cell (medians, s), and llama.cpp's over ours: the prompt's speed."""
    print("\n| engine | " + " | ".join(f"{d} time to first token (s)" for d in dtypes) + " |")
    print("|---|" + "---:|" * len(dtypes))
    for engine in engines:
        row = [f"{report[(engine, d)]['ttft_s']:.3f}" if (engine, d) in report else "–" for d in dtypes]
        print(f"| {NAMES.get(engine, engine)} | " + " | ".join(row) + " |")
    ratios = [ratio(report, d, lambda ours, theirs: theirs["ttft_s"] / ours["ttft_s"]) for d in dtypes]  # > 1: ours sooner
    print("| llama.cpp's / ours (above 1: ours sooner) | " + " | ".join(ratios) + " |")


def ratio(report: dict, dtype: str, of) -> str:
    """of(ours, llama.cpp's) for a dtype's column, bold, or a dash where either is missing: ours is the engine of that
    name for int8 and int4, the default ("cache") for fp32 and bf16."""
    ours, theirs = report.get((dtype if dtype in QUANTIZED else "cache", dtype)), report.get(("llamacpp", dtype))
    return f"**{of(ours, theirs):.2f}x**" if ours and theirs else "–"
