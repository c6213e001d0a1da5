"""The GPU check in one command, for a machine with a CUDA GPU and no internet (<= 8 minutes on an H100,
writing the checkpoints included):

    python scripts/gpu_check.py --out gpu-check/                        # the whole check
    python scripts/gpu_check.py --out gpu-check/ --steps "int8 8B,transformers 8B"   # a rerun of some
    python scripts/gpu_check.py --smoke --out /tmp/x      # every step on the CPU, tiny (tests/test_gpu_check.py)

Needs torch, transformers, safetensors, tokenizers and huggingface_hub; runs from the source tree (this package
need not be installed; no pytest plugins, no FastAPI). The steps, in order of what was least measured before,
each in its own process group with its own time limit (STEPS, seconds; killed whole at it, compile workers
included), a failure recorded and the next step run:

  engine flex       nano-vLLM's workload through our engine (64 requests), by the GPU default route (FlexAttention
                    over the pool in place, compiled per decode bucket, CUDA graphs), and the GPU's busy fraction
                    over a window of its steps (torch.profiler): scripts/bench/nano_vllm_workload.py; then
                    with steps that read their tokens back at once (flex-sync: no async scheduling)
  engine paged      the same by the gathered route, eager (the fallback)
  int4 <largest>    int4 (tinygemm) compiled, then under graphs (the default command), and graphs over plain layers
  decode <size>     ours, bf16, batch 1 (--ours): the default command (CUDA graphs over the layers' compiled
                    glue, kernels/gpu_decode.py), graphs over the plain layers, and --compile; the first size
                    also --no-cuda-graphs (eager), the baseline the graphs are measured against
  int8 <largest>    int8 under graphs by each route (the default one-row kernels; gpt-fast's fused cast eagerly;
                    torch's int8pack kernel), then compiled
  profile ...       one decode step's kernels (torch.profiler): how many, their GPU time against the step's wall
                    time, the costliest; bf16 on the first size (graphs, graphs-plain, eager, compiled), int8 and int4 on
                    the largest
  transformers <s>  transformers' generate, eager and with a fixed-length StaticCache (compiled by it)
  load benchmark    loading the first size's checkpoint onto the GPU
  cuda tests        pytest -m cuda (our CUDA tests), last: its collection alone is slow
for sizes 0.6B and 8B (--sizes); the engine runs the smallest dense size. Each decode figure is greedy from a
16-token prompt, 128 new tokens (transformers eager: 32), random weights of the exact shapes (bf16, drawn on
the GPU: only transformers and the load benchmark read a checkpoint), against the bandwidth limit measured in
the same process.

Results go to gpu_check.json and gpu_check.md in --out after every step (and each step's worker writes after
every measurement), so a run cut short keeps what it measured. No step starts after --deadline seconds,
and each step's limit is cut to what is left of it. inductor's compiled code is cached on disk
(~/.cache/qwen3-scratch/inductor), so a rerun on the same machine compiles much less.

`--smoke` runs every step on this machine's CPU with tiny shapes in about a minute (tests/test_gpu_check.py),
so that a broken check shows up in CI, not in a GPU session. Its steps run two at a time (`--jobs`: each is one
thread, and a dry run's figures are not measurements); a GPU run's run one at a time, as they must to be timed.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WORKERS = HERE / "bench" / "gpu_workers.py"
# seconds each step may take at most, on an H100 (compiles of ~60 s at 8B; the engine's flex route compiles
# one kernel per decode bucket); their sum exceeds --deadline on purpose: the order says what is cut
STEPS = {"engine flex": 220, "engine paged": 110, "int4": 150, "decode": 130, "decode 8B": 150, "int8": 150,
         "profile bf16": 120, "profile quantized": 90, "transformers": 90, "transformers 8B": 150,
         "load benchmark": 60, "cuda tests": 240}  # fmt: skip
SMOKE_LIMIT = 90  # each step of --smoke, on a CPU (two at a time: ~35 s the longest, warm)
# steps that read what an earlier step wrote (the checkpoint "transformers <size>" writes) or need the machine
# alone: with --jobs above 1 each waits for every step before it to end, and the next waits for it
ALONE = {"load benchmark", "cuda tests"}
QUANTIZED = "int4/compiled,int4/graphs,int4/graphs-plain,int8/graphs,int8cast/graphs,int8pack/graphs,int8/compiled"


def plan(args) -> list[tuple[str, list[str] | None, str]]:
    """(step name, the command that runs it or None for a skipped step, why skipped) in order."""
    py, sizes = sys.executable, args.sizes.split(",")
    cuda = args.device == "cuda"
    worker = [py, str(WORKERS)]
    common = ["--device", args.device, "--weights", str(args.weights), "--new-tokens", str(args.new_tokens)]
    largest, engine = sizes[-1], ([s for s in sizes if not s.endswith("8B")][:1] or sizes[:1])[0]
    work = lambda kind, size, variants: worker + [kind, "--size", size, "--variants", variants] + common  # noqa: E731
    quantized = {k: ",".join(v for v in args.quantized.split(",") if v.startswith(k)) for k in ("int4", "int8")}
    steps = [("engine flex", work("workload", engine, "flex,flex-sync"), ""), ("engine paged", work("workload", engine, "paged"), "")]
    steps.append((f"int4 {largest}", work("decode", largest, quantized["int4"]), ""))
    for i, size in enumerate(sizes):
        steps.append((f"decode {size}", work("decode", size, ("bfloat16/eager," if i == 0 else "") + args.ours), ""))
    steps.append((f"int8 {largest}", work("decode", largest, quantized["int8"]), ""))
    steps.append((f"profile bf16 {sizes[0]}", work("profile", sizes[0], args.profiled), ""))
    steps.append((f"profile quantized {largest}", work("profile", largest, PROFILED_QUANTIZED), ""))
    steps += [(f"transformers {size}", work("transformers", size, "eager,static-compile"), "") for size in sizes]
    load = [py, str(HERE / "bench" / "benchmark_load.py"), "--device", args.device, "--repeats", "1" if args.smoke
            else "3", "--checkpoint", str(args.weights / f"qwen3-{sizes[0].lower()}-shapes-gpucheck"), "--json",
            str(args.out / "load.json")]  # fmt: skip
    steps.append(("load benchmark", load if cuda or args.smoke else None, "the load benchmark is for a GPU"))
    # test files that import what a GPU machine lacks (FastAPI, openai) fail to collect; the rest run
    tests = [py, "-m", "pytest", "tests", "-o", "addopts=", "-m", "cuda", "-q", "-p", "no:cacheprovider",
             "--continue-on-collection-errors"]  # fmt: skip
    steps.append(("cuda tests", tests if cuda else None, "no CUDA device (a CPU run)"))
    return [(name, command, why) for name, command, why in steps if command is None or "--variants" not in command
            or command[command.index("--variants") + 1]]  # a step left with no variants (--quantized) is dropped


OURS = "bfloat16/graphs,bfloat16/graphs-plain,bfloat16/compiled"
PROFILED_BF16 = "bfloat16/graphs,bfloat16/graphs-plain,bfloat16/eager,bfloat16/compiled"
PROFILED_QUANTIZED = "int8/graphs,int4/graphs,int4/graphs-plain"


def step_limit(name: str) -> float:
    """STEPS' limit for this step, by its name ("decode 8B") or its kind ("decode")."""
    return STEPS.get(name) or STEPS.get(name.rsplit(" ", 1)[0], 90)


def run_step(command: list[str], limit: float, record: Path | None, log: Path) -> dict:
    """A subprocess with a time limit: its exit code, duration, the tail of its output and the JSON record
    its worker wrote (whatever it measured before it ended, even if it then failed).

    The child leads a process group of its own and writes to a file, not a pipe: at the limit the whole
    group is killed (inductor's compile workers too), and nothing left holding a pipe can hang the check."""
    start = time.perf_counter()
    # unbuffered, so a step killed at its limit still shows how far it got
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    with open(log, "w") as output:
        child = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
                                 start_new_session=True)  # fmt: skip
        try:
            result = {"returncode": child.wait(timeout=limit)}
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            result = {"returncode": None, "error": f"timed out after {limit:.0f} s"}
    result["output_tail"] = log.read_text(errors="replace")[-2000:]
    result["seconds"] = round(time.perf_counter() - start, 1)
    result["limit_s"] = round(limit)
    if record is not None and record.exists():
        result.update(json.loads(record.read_text()))
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="CUDA tests, decode, transformers, int8/int4 and the engine, in one run.")
    p.add_argument("--out", required=True, type=Path, help="folder for gpu_check.json and gpu_check.md")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a dry run")
    p.add_argument("--smoke", action="store_true", help="every step on the CPU with tiny shapes, ~1 minute")
    p.add_argument("--sizes", default="0.6B,8B", help="Qwen3 shapes, smallest first ('tiny' for a dry run)")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--weights", type=Path, default=ROOT / "weights", help="where the random checkpoints go")
    p.add_argument("--deadline", type=float, default=470, help="seconds after which no step starts or runs on")
    p.add_argument("--profiled", default=PROFILED_BF16, help="the bf16 profile's variants (default %(default)s)")
    p.add_argument("--ours", default=OURS, help="the decode steps' bf16 variants (default %(default)s)")
    p.add_argument("--quantized", default=QUANTIZED, help="the int4 and int8 steps' variants (default %(default)s)")
    p.add_argument("--steps", help="run only these steps (names as in gpu_check.md, comma-separated)")
    p.add_argument("--jobs", type=int, help="steps run at a time (default: 2 with --smoke, else 1; timed runs need 1)")
    args = p.parse_args(argv)
    if args.smoke:
        args.device, args.sizes, args.new_tokens = "cpu", "tiny", min(args.new_tokens, 4)
    if args.device == "cpu":
        # int4 in torch's packing, as on the GPU: the words layout an AVX2 CPU would pick builds its kernels at
        # load (the smoke's two int4 steps ran into their 60-s limit on an AMD EPYC Zen 3 with a cold cache)
        os.environ.setdefault("QWEN3_SCRATCH_INT4_LAYOUT", "torch")
    args.out.mkdir(parents=True, exist_ok=True)
    command = "python scripts/gpu_check.py " + " ".join(argv or sys.argv[1:])
    report = {"machine": machine(args.device), "command": command, "steps": {}}
    start = time.perf_counter()
    chosen = None if args.steps is None else {s.strip() for s in args.steps.split(",")}
    steps = [step for step in plan(args) if chosen is None or step[0] in chosen]
    jobs = max(1, args.jobs or (2 if args.smoke else 1))
    finished, lock = {}, threading.Lock()

    def run(name: str, command: list[str] | None, why: str) -> None:
        left = args.deadline - (time.perf_counter() - start)
        limit = min(SMOKE_LIMIT if args.smoke else step_limit(name), left)
        print(f"[{time.perf_counter() - start:5.0f} s] {name} (limit {limit:.0f} s)", flush=True)
        if command is None:
            result = {"skipped": why}
        elif limit < 10:
            result = {"skipped": f"the deadline of {args.deadline:.0f} s was reached"}
        else:
            stem = args.out / name.replace(" ", "_").replace("/", "-")
            record = stem.with_suffix(".json")
            record.unlink(missing_ok=True)
            is_worker = command[1] == str(WORKERS)
            result = run_step(command + (["--out", str(record)] if is_worker else []), limit,
                              record if is_worker else None, stem.with_suffix(".log"))  # fmt: skip
        with lock:  # the report in the plan's order, rewritten as each step ends
            finished[name] = result
            print(f"         {name}: {summary(result)}", flush=True)
            report["steps"] = {n: finished[n] for n, _, _ in steps if n in finished}
            report["elapsed_s"] = round(time.perf_counter() - start, 1)
            write_report(report, args.out)

    with ThreadPoolExecutor(jobs) as pool:
        running = []
        for step in steps:
            if step[0] in ALONE or jobs == 1:
                for future in running:
                    future.result()
                running = []
                run(*step)
            else:
                running.append(pool.submit(run, *step))
        for future in running:
            future.result()
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
    lines += ["", "| size | what | decode tok/s (engine: output tok/s) | % of bandwidth limit | TTFT (s) "
              "| warm-up / compile (s) |",
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
    if "output_tok_s" in r:  # the engine workload: output tok/s in the tok/s column
        busy = f"GPU busy {r['gpu_busy']:.0%} over {r['busy_window_steps']} steps" if "gpu_busy" in r else "no GPU"
        route = r["route"] + (f", fell back: {r['fallback']}" if r.get("fallback") else "")
        what = f"{key} ({r['requests']} requests, {r['output_tokens']} output tokens; {busy}; ran {route})"
        return f"| {size} | {what} | {r['output_tok_s']:.1f} | | | {r['warmup_s']:.1f} |"
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
