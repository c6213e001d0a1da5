"""`qwen3-serve` that counts the shapes its model runs: which shapes a serving step takes, and how many.

    python scripts/bench/serve_shapes.py --shapes-out shapes.json --model weights/tiny-qwen3 --port 8000 ...
    python scripts/soak.py --url http://127.0.0.1:8000 --model weights/tiny-qwen3 ...   # load it meanwhile

Every flag but --shapes-out is qwen3-serve's. Each `Qwen3.forward` the engine makes is counted by
(B rows, T tokens, S keys): a decode batch is (B, 1, S), a prompt chunk (1, T, S). The counts go to
--shapes-out every 5 s and at exit, with a summary: how many distinct values B, T and S took, and how many
distinct (B, T, S). Caches keyed by shape (oneDNN's primitives, one per matrix shape; compiled graphs)
grow with these numbers, and the resident memory with them (docs/performance.md, issue 32), so this is
how to see that bucketing the shapes bounds them.
"""

import argparse
import json
import sys
import threading
import time
from collections import Counter

from qwen3_scratch.cli.serve import main
from qwen3_scratch.model.qwen3 import Qwen3

shapes: Counter = Counter()  # (B, T, S) -> forwards


def count_shapes() -> None:
    forward = Qwen3.forward

    def counted(self, input_ids, position_ids=None, mask=None, *args, **kwargs):
        B, T = input_ids.shape
        shapes[(B, T, mask.shape[-1] if mask is not None else T)] += 1
        return forward(self, input_ids, position_ids, mask, *args, **kwargs)

    Qwen3.forward = counted


def summary() -> dict:
    counts = dict(shapes)
    return {
        "forwards": sum(counts.values()),
        "distinct": {"B": len({b for b, _, _ in counts}), "T": len({t for _, t, _ in counts}),
                     "S": len({s for _, _, s in counts}), "(B, T, S)": len(counts)},  # fmt: skip
        "shapes": {f"B={b} T={t} S={s}": n for (b, t, s), n in sorted(counts.items())},
    }


def write(path: str) -> None:
    with open(path, "w") as f:
        json.dump(summary(), f, indent=1)


def write_every(path: str, seconds: float = 5.0) -> None:
    while True:
        time.sleep(seconds)
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
