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

    python scripts/bench/cold_start.py --warm [--baseline /tmp/base]    # second starts only, ~1 min

--warm times later runs only, with the kernels stored in the cache ($QWEN3_SCRATCH_CACHE or the default):
`qwen3-generate` to its first token, `qwen3-chat` answering one line with one token, `qwen3-serve` until /health
answers; with --baseline, the same commands from another checkout (e.g. `git worktree add /tmp/base <commit>`)
alternate with ours. First each command starts untimed and the builder is waited for, until a pass stores no new
kernel (a checkout whose kernels changed would otherwise be timed while they build: a server 10.9-11.6 s to ready
instead of 3.1).
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


def wait_for_tables(limit: float = 120.0) -> None:
    """Until no process left by a start is storing a tokenizer's table (text/bpe.py: it runs once that start has
    exited), so that no timed start reads tokenizer.json while the table is on its way."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        storing = False
        for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
            try:
                storing |= b"qwen3_scratch.text.bpe" in cmdline.read_bytes()
            except OSError:
                pass
        if not storing:
            return
        time.sleep(0.5)


def user_environment(**extra: str) -> dict:
    """This process's environment for a timed start, less PYTHONDONTWRITEBYTECODE: a user's Python writes each
    module's bytecode at its first import and reads it at every later start, where a machine that sets the variable
    (this project's sandboxes do) compiles our modules and the server's from source at every start, ~0.1-0.3 s
    of a second start (docs/performance.md). Every command timed, ours and llama.cpp's, starts so."""
    import os

    return {name: value for name, value in os.environ.items() if name != "PYTHONDONTWRITEBYTECODE"} | extra


def timed(command: list[str], env: dict | None = None) -> float:
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=user_environment(**(env or {})))
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-2000:]}")
    return seconds


def warm_commands(with_tokenizer: Path, dtype: str) -> dict[str, list[str]]:
    """The three commands' second starts, each ending at its first token (serve: its first ready answer)."""
    with_tokenizer = with_tokenizer.resolve()  # each command runs in its own checkout (python puts it first on sys.path)
    weights = ["--dtype", "bfloat16", "--quantize", dtype] if dtype in ("int8", "int4") else ["--dtype", dtype]
    model = ["--model", str(with_tokenizer), *weights, "--temperature", "0", "--max-new-tokens", "1"]
    return {"qwen3-generate": ["-m", "qwen3_scratch.generate", "--prompt", "Hi", *model],
            "qwen3-chat": ["-m", "qwen3_scratch.chat", *model],
            "qwen3-serve (to ready)": ["-m", "qwen3_scratch.serve", "--model", str(with_tokenizer), *weights,
                                       "--port", "8391"]}  # fmt: skip


def timed_warm(name: str, args: list[str], root: Path) -> float:
    """One start of a command from the checkout at `root`: the whole process, or for the server, until /health answers."""
    import urllib.request

    env = user_environment(PYTHONPATH=str(root))
    start = time.perf_counter()
    if not name.startswith("qwen3-serve"):
        done = subprocess.run([sys.executable, *args], input="Hi\n", capture_output=True, text=True, cwd=root, env=env)
        if done.returncode != 0:
            raise SystemExit(f"{name} failed:\n{done.stderr[-2000:]}")
        return time.perf_counter() - start
    server = subprocess.Popen([sys.executable, *args], cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        while server.poll() is None:
            try:
                with urllib.request.urlopen("http://127.0.0.1:8391/health", timeout=1):
                    return time.perf_counter() - start
            except OSError:
                time.sleep(0.02)
        raise SystemExit(f"{name} exited:\n{server.stderr.read().decode()[-2000:]}")
    finally:
        server.terminate()
        server.wait()


def store_every_kernel(commands: dict, trees: dict) -> None:
    """Each command of each checkout started once, untimed, then the builder (and the tokenizer's table) waited for,
    until a pass stores no new kernel: what is missing is built now, not during the timed rounds (a builder that
    finds another at work leaves its kernels to a later start, so one pass can leave some)."""
    from qwen3_scratch.kernels import aot

    def stored() -> int:
        return len(list(aot.cache_root().glob(f"*/*/{aot.ENTRY}")))

    while True:
        before = stored()
        for tree in trees.values():
            for name, args in commands.items():
                timed_warm(name, args, tree)
        wait_for_builder(str(aot.cache_root().parent))  # the folder the commands store their kernels in
        wait_for_tables()
        if stored() == before:
            return


def warm(args, with_tokenizer: Path) -> None:
    """Second starts only: ours (and --baseline's) commands, alternating, medians."""
    trees = {"ours": ROOT, **({"baseline": Path(args.baseline).resolve()} if args.baseline else {})}
    commands = warm_commands(with_tokenizer, args.dtype)
    runs = {(tree, name): [] for name in commands for tree in trees}
    gguf = gguf_path(Path(args.checkpoint), args.dtype)
    if llama_available() and gguf.exists():
        runs["llama.cpp", "llama-cpp-python, one token"] = []
    store_every_kernel(commands, trees)
    for round_index in range(args.repeats):
        for (tree, name), seconds in runs.items():
            if tree == "llama.cpp":
                seconds.append(timed([sys.executable, "-c", LLAMA, str(gguf)]))
            else:
                seconds.append(timed_warm(name, commands[name], trees[tree]))
        print(f"round {round_index + 1}: " + ", ".join(f"{t} {n} {v[-1]:.2f} s" for (t, n), v in runs.items()), flush=True)
    print("\n" + machine_line(machine()))
    print(f"{args.dtype}, second start (kernels stored), process start to first token (median of {args.repeats}):\n")
    table = Table("command", "checkout", "seconds", "runs (s)", text_columns=2)
    for (tree, name), seconds in runs.items():
        table.row(name, tree, f"{statistics.median(seconds):.2f}", ", ".join(f"{s:.2f}" for s in seconds))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", default="weights/qwen3-0.6b-shapes", help="the shape checkpoint (its GGUF beside it)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "int8", "int4"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warm", action="store_true", help="second starts only, the kernels already stored (see above)")
    p.add_argument("--baseline", help="with --warm: another checkout whose commands alternate with ours")
    args = p.parse_args(argv)
    checkpoint = Path(args.checkpoint)
    with_tokenizer = checkpoint.parent / (checkpoint.name + "-with-tokenizer")
    if args.warm:
        return warm(args, with_tokenizer)
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
            wait_for_tables()
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
