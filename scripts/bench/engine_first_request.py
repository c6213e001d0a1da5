"""The engine's first request after a start, and its decode steps: what a server's user waits for.

    python scripts/bench/engine_first_request.py --checkpoint weights/qwen3-0.6b-shapes-with-tokenizer
    QWEN3_SCRATCH_AOT=0 python scripts/bench/engine_first_request.py ...      # kernels compiled, never stored

Times the load (`LLM(...)`), then three `generate` calls of two prompts and 16 greedy tokens each (the first
pays for whatever the process builds at its first decode step: the in-place paged attention, compiled or
loaded from its stored package), then the median decode step of `--rows` requests (64 prompt tokens, 40 new
tokens; the second of two runs). Run it alone, alternating trees or settings, one process per measurement.
"""

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for path in (ROOT, ROOT / "scripts" / "bench"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))


def decode_steps(engine, rows: int, seed: int) -> list[float]:
    from qwen3_scratch.sampling.params import SamplingParams

    rng = random.Random(seed)
    for i in range(rows):
        ids = [rng.randint(0, 5000) for _ in range(64)]
        engine.add_request(f"{seed}-{i}", ids, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    times = []
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times[3:-2]  # the prefill steps and the last rows' ends left out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", default=str(ROOT / "weights" / "qwen3-0.6b-shapes-with-tokenizer"))
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--rows", type=int, default=1, help="requests decoded together for the step time (default 1)")
    args = p.parse_args(argv)
    start = time.perf_counter()
    from qwen3_scratch.engine.llm import LLM
    from qwen3_scratch.sampling.params import SamplingParams

    llm = LLM(args.checkpoint, dtype=args.dtype)
    loaded = time.perf_counter() - start
    calls = []
    for i in range(3):
        start = time.perf_counter()
        llm.generate([[100 + i, 200, 300, 400, 500, 600] * 3, [7, 8, 9 + i] * 5],
                     SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))  # fmt: skip
        calls.append(round(time.perf_counter() - start, 2))
    decode_steps(llm.engine, args.rows, seed=0)  # warm
    step = statistics.median(decode_steps(llm.engine, args.rows, seed=1))

    from machine import Table, machine, machine_line  # after the timings: it imports transformers

    from qwen3_scratch.kernels import aot

    print(machine_line(machine()))
    table = Table("checkpoint", "stored kernels", "load, s", "generate calls, s", f"decode step at {args.rows} rows, ms",
                  text_columns=3)  # fmt: skip
    table.row(f"{Path(args.checkpoint).name} {args.dtype}", "on" if aot.enabled() else "off", f"{loaded:.2f}",
              ", ".join(map(str, calls)), f"{step * 1e3:.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
