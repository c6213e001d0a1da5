"""`qwen3-serve` that counts the shapes its model runs: which shapes a serving step takes, and how many.

    python scripts/bench/serve_shapes.py --shapes-out shapes.json --model weights/tiny-qwen3 --port 8000 ...
    python scripts/bench/soak.py --url http://127.0.0.1:8000 --model weights/tiny-qwen3 ...   # load it meanwhile

Every flag but --shapes-out is qwen3-serve's. An engine step is one packed forward (engine/batch.py): all its
rows' tokens as one (1, N) sequence. Each `Qwen3.forward` is counted by the shapes its ops see:

  tokens            N, the rows every linear layer, norm and the MLP run (oneDNN keeps a primitive per shape)
  logits            M, the rows the vocabulary projection runs (the tokens whose logits the step keeps)
  decode attention  (B, W): the decode rows read in place, and their tables' width in blocks
  prompt attention  (T, S): each prompt row's queries and keys (SDPA over its gathered blocks)
  step              the whole (N, M, decode (B, W), prompt rows) tuple

The counts go to --shapes-out every 5 s and at exit, with how many distinct values each took, when each shape
was first run (seconds after start), dynamo's compile counters, and a memory sample every 5 s: the resident
memory, what glibc's malloc holds in use and free (mallinfo2, every arena), and the number of Python objects,
so that growth can be told apart: new shapes, the allocator keeping freed memory, or objects piling up.
Caches keyed by shape (oneDNN's primitives, compiled graphs) grow with the shape counts, and the resident
memory with them (docs/performance.md, "Flat memory under serving"), so this is how to see that the
engine's buckets (engine/buckets.py) bound them.
"""

import argparse
import ctypes
import gc
import json
import sys
import threading
import time
from collections import Counter

import psutil
import torch

from qwen3_scratch.cli.serve import main
from qwen3_scratch.model.qwen3 import Qwen3

OPS = ("tokens", "logits", "decode attention", "prompt attention", "step")
shapes: dict[str, Counter] = {op: Counter() for op in OPS}
first_seen: dict[str, dict] = {op: {} for op in OPS}  # op -> shape -> seconds after start
memory: list[dict] = []  # a sample every 5 s
STARTED = time.monotonic()


def step_shapes(input_ids, cache, logits_at) -> dict:
    """op -> the shapes it runs in this forward (a list: a step has several prompt rows)."""
    N = input_ids.shape[-1]
    found = {"tokens": [N], "logits": [N if logits_at is None else len(logits_at)]}
    batch = getattr(cache, "batch", None)  # a PackedView (engine/packed_view.py); else a plain cache
    if batch is not None and getattr(cache, "route", None) == "paged":
        B = batch.num_decodes
        found["decode attention"] = [(B, cache.decode_width)] if B else []
        found["prompt attention"] = [tuple(row[2].shape[-2:]) for row in cache.prompt_rows]  # (T, S), exact
    found["step"] = [tuple(tuple(v) for v in found.values())]
    return found


def count_shapes() -> None:
    forward = Qwen3.forward

    def counted(self, input_ids, position_ids=None, mask=None, cache=None, *args, **kwargs):
        for op, seen in step_shapes(input_ids, cache, kwargs.get("logits_at")).items():
            shapes[op].update(seen)
            for shape in seen:
                first_seen[op].setdefault(shape, round(time.monotonic() - STARTED))
        return forward(self, input_ids, position_ids, mask, cache, *args, **kwargs)

    Qwen3.forward = counted


class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]  # fmt: skip


def sample_memory() -> dict:
    """RSS, malloc's bytes in use and free-but-held (MiB), Python objects, distinct shapes so far."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    info = libc.mallinfo2()
    mib = lambda n: round(n / 2**20, 1)  # noqa: E731
    return {"t": round(time.monotonic() - STARTED), "rss": mib(psutil.Process().memory_info().rss),
            "malloc_in_use": mib(info.uordblks + info.hblkhd), "malloc_free": mib(info.fordblks),
            "objects": len(gc.get_objects()), "tokens": len(shapes["tokens"]),
            "prompt attention": len(shapes["prompt attention"])}  # fmt: skip


def summary() -> dict:
    counts = {op: dict(counter) for op, counter in shapes.items()}
    stats = torch._dynamo.utils.counters
    return {
        "forwards": sum(counts["tokens"].values()),
        "distinct": {op: len(c) for op, c in counts.items()},
        "dynamo": {"unique_graphs": stats["stats"]["unique_graphs"], "recompiles": sum(stats["recompiles"].values())},
        "shapes": {op: {str(shape): n for shape, n in sorted(c.items(), key=str)} for op, c in counts.items()
                   if op != "step"},  # fmt: skip
        "first_seen_s": {op: {str(shape): t for shape, t in seen.items()} for op, seen in first_seen.items()
                         if op != "step"},  # fmt: skip
        "memory": memory,
    }


def write(path: str) -> None:
    with open(path, "w") as f:
        json.dump(summary(), f, indent=1)


def write_every(path: str, seconds: float = 5.0) -> None:
    while True:
        time.sleep(seconds)
        memory.append(sample_memory())
        write(path)


if __name__ == "__main__":
    own = argparse.ArgumentParser(description="qwen3-serve, counting the shapes its model runs", add_help=False)
    own.add_argument("--shapes-out", required=True, help="where the counts go (JSON, every 5 s and at exit)")
    args, argv = own.parse_known_args(sys.argv[1:])
    path = args.shapes_out
    count_shapes()
    threading.Thread(target=write_every, args=(path,), daemon=True).start()
    try:
        status = main(argv)
    finally:
        write(path)
    raise SystemExit(status)
