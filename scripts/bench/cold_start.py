"""Cold start: a new process, from its start to its first token and exit, ours against llama.cpp.

    python scripts/bench/llamacpp_engine.py --convert weights/qwen3-0.6b-shapes --llama-cpp DIR   # once: GGUF + tokenizer
    python scripts/bench/cold_start.py                                  # bf16, 3 alternating rounds

Ours: `python -m qwen3_scratch.generate --max-new-tokens 1` on the 0.6B shapes with Qwen3's real vocabulary
(the `-with-tokenizer` folder `llamacpp_engine.py --convert` writes), so it pays what a user pays: Python,
torch's import, the load, the compiled CPU decode kernels, the prompt, one token. Three times per round,
with inductor's cache and ours (kernels/aot.py) in empty folders: a *first run ever* (inductor builds
every kernel and hands them to the background builder), then, once that builder is done, a *second
run* with stored kernels turned off (QWEN3_SCRATCH_AOT=0: inductor's cache only, the second start
before issue 30) and a *later run* (every kernel loaded from its AOTInductor package). llama.cpp, when
llama-cpp-python is installed and the GGUF converted: a Python process that loads the GGUF of the same
weights and makes one token. Each is the wall time of the whole process, measured here around it; the
rounds alternate them, and the table gives medians.
"""

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

from llamacpp_engine import gguf_path  # noqa: E402
from machine import Table, machine, machine_line  # noqa: E402

LLAMA = """
import sys
from llama_cpp import Llama
llm = Llama(sys.argv[1], n_ctx=256, n_threads=2, verbose=False)
ids = llm.tokenize(b"Hi")
print(next(llm.generate(ids, temp=0.0, top_k=1)))
"""


def wait_for_builder(cache: str) -> None:
    """Until the background builder the first run started is done: it deletes its list of kernels, then
    holds build.lock while it builds."""
    import fcntl

    while list(Path(cache, "aot").glob("*/*.json")):
        time.sleep(0.5)
    for lock in Path(cache, "aot").glob("*/build.lock"):
        with open(lock) as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)  # blocks while the builder runs


def timed(command: list[str], env: dict | None = None) -> float:
    import os

    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env={**os.environ, **(env or {})})
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-2000:]}")
    return seconds


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", default="weights/qwen3-0.6b-shapes", help="the shape checkpoint (its GGUF beside it)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "int8", "int4"])
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    checkpoint = Path(args.checkpoint)
    with_tokenizer = checkpoint.parent / (checkpoint.name + "-with-tokenizer")
    quantized = args.dtype in ("int8", "int4")
    ours = [sys.executable, "-m", "qwen3_scratch.generate", "--model", str(with_tokenizer), "--prompt", "Hi",
            "--max-new-tokens", "1", "--temperature", "0", "--dtype", "bfloat16" if quantized else args.dtype] \
        + (["--quantize", args.dtype] if quantized else [])  # fmt: skip
    gguf = gguf_path(checkpoint, args.dtype)
    theirs = [sys.executable, "-c", LLAMA, str(gguf)] if llama_available() and gguf.exists() else None
    if theirs is None:
        print(f"llama.cpp skipped: llama-cpp-python is not installed or {gguf} is missing", flush=True)
    names = ["ours, first run (empty caches)", "ours, second run (inductor's cache)", "ours, later run (stored kernels)"]
    runs = {name: [] for name in names + (["llama.cpp"] if theirs else [])}
    for round_index in range(args.repeats):
        with tempfile.TemporaryDirectory() as cache:
            env = {"TORCHINDUCTOR_CACHE_DIR": cache + "/inductor", "QWEN3_SCRATCH_CACHE": cache, "PYTHONPATH": str(ROOT)}
            if theirs:
                runs["llama.cpp"].append(timed(theirs))
            runs[names[0]].append(timed(ours, env))
            wait_for_builder(cache)  # it would share the cores with the next run
            runs[names[1]].append(timed(ours, {**env, "QWEN3_SCRATCH_AOT": "0"}))  # the second start before issue 30
            runs[names[2]].append(timed(ours, env))
        print(f"round {round_index + 1}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in runs.items()), flush=True)
    base = statistics.median(runs["llama.cpp"]) if theirs else None
    print("\n" + machine_line(machine()))
    print(f"{args.dtype}, process start to first token and exit (median of {args.repeats}):\n")
    table = Table("process", "seconds", "/ llama.cpp", "runs (s)")
    for name, seconds in runs.items():
        median = statistics.median(seconds)
        table.row(name, f"{median:.2f}", f"{median / base:.2f}x" if base else "-", ", ".join(f"{s:.2f}" for s in seconds))


def llama_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None

if __name__ == "__main__":
    main()
