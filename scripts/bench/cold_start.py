"""Cold start: a new process, from its start to its first token and exit, ours against llama.cpp.

    python scripts/bench/llamacpp_engine.py --convert weights/qwen3-0.6b-shapes --llama-cpp DIR   # once: GGUF + tokenizer
    python scripts/bench/cold_start.py                                  # bf16, 3 alternating rounds

Ours: `python -m qwen3_scratch.generate --max-new-tokens 1` on the 0.6B shapes with Qwen3's real vocabulary
(the `-with-tokenizer` folder `llamacpp_engine.py --convert` writes), so it pays what a user pays: Python,
torch's import, the load, building the compiled CPU decode kernels, the prompt, one token. Twice per round:
a *first run ever* (inductor's caches pointed at an empty folder, TORCHINDUCTOR_CACHE_DIR) and a *second
run* (the same folder again, as every later run finds it). llama.cpp: a Python process that imports
llama-cpp-python, loads the GGUF of the same weights and makes one token. Each is the wall time of the
whole process, measured here around it; the rounds alternate the three, and the table gives medians.
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
    theirs = [sys.executable, "-c", LLAMA, str(gguf_path(checkpoint, args.dtype))]
    runs = {"ours, first run (empty kernel cache)": [], "ours, second run": [], "llama.cpp": []}
    for round_index in range(args.repeats):
        with tempfile.TemporaryDirectory() as cache:
            env = {"TORCHINDUCTOR_CACHE_DIR": cache, "PYTHONPATH": str(ROOT)}
            runs["llama.cpp"].append(timed(theirs))
            runs["ours, first run (empty kernel cache)"].append(timed(ours, env))
            runs["ours, second run"].append(timed(ours, env))
        print(f"round {round_index + 1}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in runs.items()), flush=True)
    llama = statistics.median(runs["llama.cpp"])
    print("\n" + machine_line(machine()))
    print(f"{args.dtype}, process start to first token and exit (median of {args.repeats}):\n")
    table = Table("process", "seconds", "/ llama.cpp", "runs (s)")
    for name, seconds in runs.items():
        median = statistics.median(seconds)
        table.row(name, f"{median:.2f}", f"{median / llama:.2f}x", ", ".join(f"{s:.2f}" for s in seconds))


if __name__ == "__main__":
    main()
