"""A prompt's fp32 products by MKL and by oneDNN (kernels/sgemm.py), side by side in one process, rounds alternating.

    python scripts/bench/prompt_ab.py                              # fp32, bf16, int8, int4; 16, 64 and 300 tokens
    python scripts/bench/prompt_ab.py --models float32 --prompt-tokens 16 --rounds 7

For each model of the 0.6B shapes in the CLI's layout (optimize="decode"), one forward over a random prompt to
the last position's logits (what the first token waits for, without sampling), with several-row fp32 products
run by MKL's sgemm and by oneDNN's matmul in turn (sgemm.choose), on the same loaded model. fp32 models multiply
in fp32; bf16, int8 and int4 ones do where their rows are widened (kernels/widen.py: a CPU without bf16
instructions, from MIN_ROWS, MIN_INT8_ROWS and MIN_INT4_ROWS rows on). The first round is a warm-up. Prints
every round's times and the medians.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
for folder in (HERE.parents[1], HERE, HERE.parents[1] / "scripts" / "checkpoints"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

from benchmark_decode import random_prompt  # noqa: E402
from machine import Table, machine, machine_line  # noqa: E402
from make_shape_checkpoint import default_out  # noqa: E402

from qwen3_scratch.checkpoint.weights import load_model  # noqa: E402
from qwen3_scratch.generation.stats import measure_bandwidth  # noqa: E402
from qwen3_scratch.kernels import sgemm  # noqa: E402

MODELS = {"float32": (torch.float32, None), "bfloat16": (torch.bfloat16, None),
          "int8": (torch.bfloat16, "int8"), "int4": (torch.bfloat16, "int4")}  # fmt: skip


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated from {', '.join(MODELS)}")
    p.add_argument("--prompt-tokens", default="16,64,300", help="comma-separated prompt lengths")
    p.add_argument("--rounds", type=int, default=5, help="rounds of both choices; the first is a warm-up")
    p.add_argument("--checkpoint", type=Path, default=None, help="default: weights/qwen3-0.6b-shapes")
    args = p.parse_args(argv)
    names = args.models.split(",")
    if unknown := [n for n in names if n not in MODELS]:
        p.error(f"--models: {', '.join(unknown)} not one of {', '.join(MODELS)}")
    lengths = [int(n) for n in args.prompt_tokens.split(",")]
    if args.rounds < 2 or min(lengths) < 1:
        p.error("--rounds: 2 or more (the first is a warm-up); --prompt-tokens: 1 or more each")
    checkpoint = args.checkpoint or default_out("0.6B")
    if not (checkpoint / "config.json").exists():
        raise SystemExit(f"{checkpoint}: no checkpoint; make it with scripts/checkpoints/make_shape_checkpoint.py")
    torch.set_grad_enabled(False)
    print(machine_line(machine("cpu", measure_bandwidth("cpu"))))
    print(f"command: python scripts/bench/prompt_ab.py {' '.join(argv or sys.argv[1:])}")
    print(f"sgemm's default here: {'onednn' if sgemm.default_uses_onednn() else 'mkl'} "
          f"(CPU vendor {sgemm.cpu_vendor() or 'unknown'})\n")
    table = Table("model", "prompt tokens", "MKL, ms", "oneDNN, ms", "MKL / oneDNN", text_columns=1)
    for name in names:
        dtype, quantize = MODELS[name]
        model = load_model(checkpoint, dtype=dtype, optimize="decode", quantize=quantize)
        for length in lengths:
            prompt = torch.tensor([random_prompt(length, model.config.vocab_size)])
            times = {choice: [] for choice in sgemm.CHOICES}
            for _ in range(args.rounds):
                for choice in sgemm.CHOICES:
                    with sgemm.choose(choice):
                        start = time.perf_counter()
                        model(prompt, last_only=True)
                        times[choice].append(time.perf_counter() - start)
            mkl, onednn = (statistics.median(times[c][1:]) * 1e3 for c in sgemm.CHOICES)
            print(f"  {name}, {length} tokens: " + "; ".join(
                f"{c} " + ", ".join(f"{t * 1e3:.0f}" for t in times[c][1:]) for c in sgemm.CHOICES), file=sys.stderr)
            table.row(name, length, f"{mkl:.0f}", f"{onednn:.0f}", f"{mkl / onednn:.2f}x")
        del model


if __name__ == "__main__":
    main()
