"""Where a start of `qwen3-generate` goes: wall and CPU time of each phase, from process start to first token.

    OMP_NUM_THREADS=1 python scripts/bench/start_breakdown.py [qwen3-generate's arguments]

Without arguments: the 0.6B shapes with Qwen3's vocabulary (cold_start.py's folder), prompt "Hi", one greedy
token in bf16. Each phase is a function of ours wrapped with a timer (so nested phases
are indented and counted in their parent); CPU time is this process's, which neighbours on a shared machine
inflate less than wall time, above all with one thread (docs/performance.md, "Cold start: second start").
The imports are timed here, before the command runs, so its own `loading()` does not cover them.
"""

import sys
import time

START_WALL, START_CPU = time.perf_counter(), time.process_time()
TOTALS: dict[str, list] = {}  # phase -> [calls, wall, cpu]


class Phase:
    def __init__(self, name: str):
        self.name = name

    def __enter__(self):
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def __exit__(self, *exc):
        total = TOTALS.setdefault(self.name, [0, 0.0, 0.0])
        total[0] += 1
        total[1] += time.perf_counter() - self.wall
        total[2] += time.process_time() - self.cpu


def wrap(owner, attribute: str, name: str) -> None:
    function = getattr(owner, attribute)

    def timed(*args, **kwargs):
        with Phase(name):
            return function(*args, **kwargs)

    setattr(owner, attribute, timed)


DEFAULT = ["--model", "weights/qwen3-0.6b-shapes-with-tokenizer", "--prompt", "Hi", "--max-new-tokens", "1",
           "--temperature", "0", "--dtype", "bfloat16"]  # fmt: skip


def main() -> None:
    with Phase("import torch"):
        import torch  # noqa: F401
    with Phase("our imports (cli, pipeline, checkpoint, text)"):
        import qwen3_scratch.cli.generate as cli
        import qwen3_scratch.generation.pipeline as pipeline
        from qwen3_scratch.checkpoint import weights
        from qwen3_scratch.generation import loops
        from qwen3_scratch.kernels import aot
        from qwen3_scratch.text import tokenizer
    wrap(pipeline, "resolve_checkpoint", "resolve the checkpoint folder")
    wrap(tokenizer.Tokenizer, "from_checkpoint", "tokenizer.json")
    wrap(tokenizer.Tokenizer, "check_fits_model", "tokenizer fits the model")
    wrap(pipeline, "load_model", "load_model (map, layout, kernels)")
    wrap(weights, "optimize_layout", "  layout")
    wrap(aot, "load", "    stored kernel loads")
    wrap(loops, "prefill", "the prompt (prefill)")
    with Phase("the command (all of the above from tokenizer.json on)"):
        cli.main(sys.argv[1:] or DEFAULT)
    TOTALS["in this process"] = [1, time.perf_counter() - START_WALL, time.process_time() - START_CPU]
    print(f"\n| phase | calls | wall ms | CPU ms |\n|---|---:|---:|---:|", file=sys.stderr)
    for name, (calls, wall, cpu) in TOTALS.items():
        print(f"| {name} | {calls} | {1000 * wall:.0f} | {1000 * cpu:.0f} |", file=sys.stderr)


if __name__ == "__main__":
    main()
