"""The GPU check in one command, for a machine with a CUDA GPU and no internet (<= 8 minutes on an H100,
writing the checkpoints included):

    python scripts/gpu_check.py --out gpu-check/                        # the whole check
    python scripts/gpu_check.py --out gpu-check/ --steps "int8/int4 8B,transformers 8B"   # a rerun of some
    python scripts/gpu_check.py --device cpu --sizes tiny --out /tmp/x    # the dry run tests/test_gpu_check.py runs

Needs torch, transformers, safetensors, tokenizers and huggingface_hub; runs from the source tree (this package
need not be installed; no pytest plugins, no FastAPI). The steps, in order of how much their figures matter,
each in its own process with its own time limit (STEPS, seconds), a failure recorded and the next step run:

  cuda tests        pytest -m cuda (our CUDA tests: graphs, int8/int4 routes, parity, sync-free decode)
  decode <size>     ours, bf16, batch 1: the default command (CUDA graphs) and --compile; the first size
                    also --no-cuda-graphs (eager), the baseline the graphs are measured against
  transformers <s>  transformers' generate, eager and with a fixed-length StaticCache (compiled by it)
  engine workload   nano-vLLM's benchmark through our engine (scripts/bench/nano_vllm_workload.py's run())
  engine busy       the GPU's busy fraction over an engine run (64 prompts x 32 new tokens), torch.profiler
  int8/int4 <size>  int8 by both routes (gpt-fast's fused cast; torch's int8pack kernel) and int4, as the
                    default command, then int8 (fused cast) and int4 with --compile
for sizes 0.6B and 8B (--sizes); the int8/int4 and transformers steps of the largest size come last. Each
decode figure is greedy from a 16-token prompt, 128 new tokens (transformers eager: 32), random weights
of the exact shapes (bf16), against the bandwidth limit measured in the same process.

Results go to gpu_check.json and gpu_check.md in --out after every step (and each step's worker writes after
every measurement), so a run cut short keeps what it measured. No step starts after --deadline seconds,
and each step's limit is cut to what is left of it. inductor's compiled code is cached on disk
(~/.cache/qwen3-scratch/inductor), so a rerun on the same machine compiles much less.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WORKERS = HERE / "bench" / "gpu_workers.py"
# seconds each step may take at most, on an H100 (8B: ~16 GB of checkpoint to write, compiles of ~60 s)
STEPS = {"cuda tests": 75, "decode": 110, "decode 8B": 170, "transformers": 90, "transformers 8B": 120,
         "engine workload": 90, "engine busy": 60, "int8/int4": 200, "load benchmark": 90}  # fmt: skip
QUANTIZED = "int8/graphs,int8pack/graphs,int4/graphs,int8/compiled,int4/compiled"


def plan(args) -> list[tuple[str, list[str] | None, str]]:
    """(step name, the command that runs it or None for a skipped step, why skipped) in order."""
    py, sizes = sys.executable, args.sizes.split(",")
    cuda = args.device == "cuda"
    worker = [py, str(WORKERS)]
    common = ["--device", args.device, "--weights", str(args.weights), "--new-tokens", str(args.new_tokens)]
    largest = sizes[-1]
    ours = "bfloat16/graphs,bfloat16/compiled"
    # test files that import what a GPU machine lacks (FastAPI, openai) fail to collect; the rest run
    tests = [py, "-m", "pytest", "tests", "-o", "addopts=", "-m", "cuda", "-q", "-p", "no:cacheprovider",
             "--continue-on-collection-errors"]  # fmt: skip
    steps = [("cuda tests", tests if cuda else None, "no CUDA device (dry run)")]
    for i, size in enumerate(sizes):
        variants = ("bfloat16/eager," + ours) if i == 0 else ours
        steps.append((f"decode {size}", worker + ["decode", "--size", size, "--variants", variants] + common, ""))
        if size != largest:
            steps.append((f"transformers {size}", worker + ["transformers", "--size", size, "--variants",
                                                            "eager,static-compile"] + common, ""))  # fmt: skip
    engine = [c for c in sizes if not c.endswith("8B")][:1] or sizes[:1]  # the engine runs the smallest dense size
    steps.append(("engine workload", worker + ["workload", "--size", engine[0]] + common, ""))
    steps.append(("engine busy", worker + ["busy", "--size", engine[0]] + common, ""))
    steps.append((f"int8/int4 {largest}", worker + ["decode", "--size", largest, "--variants", args.quantized] + common,
                  ""))  # fmt: skip
    steps.append((f"transformers {largest}", worker + ["transformers", "--size", largest, "--variants",
                                                      "eager,static-compile"] + common, ""))  # fmt: skip
    load = [py, str(HERE / "bench" / "benchmark_load.py"), "--device", "cuda", "--repeats", "3", "--checkpoint",
            str(args.weights / f"qwen3-{sizes[0].lower()}-shapes-gpucheck"), "--json", str(args.out / "load.json")]
    steps.append(("load benchmark", load if cuda else None, "the load benchmark measures loading onto a GPU"))
    return steps


def step_limit(name: str) -> float:
    """STEPS' limit for this step, by its name ("decode 8B") or its kind ("decode")."""
    return STEPS.get(name) or STEPS.get(name.rsplit(" ", 1)[0], 90)


def run_step(command: list[str], limit: float, record: Path | None) -> dict:
    """A subprocess with a time limit: its exit code, duration, the tail of its output and the JSON record
    its worker wrote (whatever it measured before it ended, even if it then failed)."""
    start = time.perf_counter()
    # unbuffered, so a step killed at its limit still shows how far it got
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=limit, cwd=ROOT, env=env)
        result = {"returncode": done.returncode, "output_tail": (done.stdout + done.stderr)[-2000:]}
    except subprocess.TimeoutExpired as e:
        text = lambda b: b.decode(errors="replace") if isinstance(b, bytes) else (b or "")  # noqa: E731
        tail = text(e.stdout) + text(e.stderr)
        result = {"returncode": None, "error": f"timed out after {limit:.0f} s", "output_tail": tail[-2000:]}
    result["seconds"] = round(time.perf_counter() - start, 1)
    result["limit_s"] = round(limit)
    if record is not None and record.exists():
        result.update(json.loads(record.read_text()))
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="CUDA tests, decode, transformers, int8/int4 and the engine, in one run.")
    p.add_argument("--out", required=True, type=Path, help="folder for gpu_check.json and gpu_check.md")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: the dry run")
    p.add_argument("--sizes", default="0.6B,8B", help="Qwen3 shapes, smallest first ('tiny' for the dry run)")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--weights", type=Path, default=ROOT / "weights", help="where the random checkpoints go")
    p.add_argument("--deadline", type=float, default=470, help="seconds after which no step starts or runs on")
    p.add_argument("--quantized", default=QUANTIZED, help="the int8/int4 step's variants (default %(default)s)")
    p.add_argument("--steps", help="run only these steps (names as in gpu_check.md, comma-separated)")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    command = "python scripts/gpu_check.py " + " ".join(argv or sys.argv[1:])
    report = {"machine": machine(args.device), "command": command, "steps": {}}
    start = time.perf_counter()
    chosen = None if args.steps is None else {s.strip() for s in args.steps.split(",")}
    for name, command, why in plan(args):
        if chosen is not None and name not in chosen:
            continue
        left = args.deadline - (time.perf_counter() - start)
        limit = min(step_limit(name), left)
        print(f"[{time.perf_counter() - start:5.0f} s] {name} (limit {limit:.0f} s)", flush=True)
        if command is None:
            report["steps"][name] = {"skipped": why}
        elif limit < 10:
            report["steps"][name] = {"skipped": f"the deadline of {args.deadline:.0f} s was reached"}
        else:
            record = args.out / f"{name.replace(' ', '_').replace('/', '-')}.json"
            record.unlink(missing_ok=True)
            is_worker = command[1] == str(WORKERS)
            report["steps"][name] = run_step(command + (["--out", str(record)] if is_worker else []), limit,
                                             record if is_worker else None)  # fmt: skip
        print(f"         {summary(report['steps'][name])}", flush=True)
        report["elapsed_s"] = round(time.perf_counter() - start, 1)
        write_report(report, args.out)
    print(f"wrote {args.out / 'gpu_check.json'} and gpu_check.md in {report.get('elapsed_s', 0)} s")
    return 0


def machine(device: str) -> dict:
    import torch

    info = {"torch": torch.__version__, "device": device}
    if device == "cuda" and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    cpu = [line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")]
    info["cpu"] = cpu[0].split(":", 1)[1].strip() if cpu else "?"
    return info


def write_report(report: dict, out: Path) -> None:
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2) + "\n")
    m = report["machine"]
    lines = [f"# GPU check: {m.get('gpu', m['cpu'])}", "",
             f"`{report['command']}`, {report.get('elapsed_s', 0)} s, torch {m['torch']}", "",
             "| step | limit (s) | result |", "|---|---:|---|"]  # fmt: skip
    for name, step in report["steps"].items():
        lines.append(f"| {name} | {step.get('limit_s', '')} | {summary(step)} |")
    lines += ["", "| size | what | decode tok/s | % of bandwidth limit | TTFT (s) | warm-up / compile (s) |",
              "|---|---|---:|---:|---:|---:|"]  # fmt: skip
    for step in report["steps"].values():
        for key, r in step.get("results", {}).items():
            lines.append(result_row(step.get("size", ""), key, r))
    (out / "gpu_check.md").write_text("\n".join(lines) + "\n")


def result_row(size: str, key: str, r: dict) -> str:
    if "decode_tok_s" in r:
        util = f"{r['util']:.0%}" if "util" in r else ""
        key += " (not compiled: transformers compiles on GPUs only)" if r.get("compiled") is False else ""
        return f"| {size} | {key} | {r['decode_tok_s']:.1f} | {util} | {r['ttft_s']:.3f} | {r['warmup_s']:.1f} |"
    if "gpu_busy_s" in r:
        fraction = r["gpu_busy_fraction"]
        busy = "no GPU kernels (CPU run)" if fraction is None else f"GPU busy {fraction:.0%}"
        run = f"{r['wall_s']:.2f} s, {r['output_tok_s']:.0f} output tok/s, {r['steps']} steps"
        return f"| {size} | {key} | {busy} of {run} | | | |"
    if "error" in r or "skipped" in r:
        return f"| {size} | {key} | {r.get('error') or r.get('skipped')} | | | |"
    scalars = {k: v for k, v in r.items() if not isinstance(v, (list, dict))}  # the workload's own figures
    shown = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in scalars.items())
    return f"| {size} | {key} | {shown} | | | |"


def summary(step: dict) -> str:
    if "skipped" in step:
        return f"skipped: {step['skipped']}"
    if step.get("error"):
        return step["error"]
    ok = step.get("returncode") == 0
    last = (step.get("output_tail") or "").strip().splitlines()[-1:] or [""]
    status = "ok" if ok else f"FAILED (exit {step.get('returncode')})"
    return f"{status} in {step.get('seconds')} s: {last[0][:120]}"


if __name__ == "__main__":
    raise SystemExit(main())
