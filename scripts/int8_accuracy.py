"""What int8 weights cost in accuracy, on the exact Qwen3-0.6B shapes: argmax agreement and the largest
logit difference against the same model in bf16, over a random prompt.

    python scripts/int8_accuracy.py                      # weights/qwen3-0.6b-shapes, 128 positions

Random weights make the top logits near-ties, so this is a harsh test of argmax agreement; a trained
model's margins are wider. (The tiny checkpoint's figures are printed by tests/test_decode_layouts.py.)
"""

import argparse
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
for folder in (HERE.parent, HERE):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

from make_shape_checkpoint import default_out  # noqa: E402

from qwen3_scratch.checkpoint.weights import load_model  # noqa: E402


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", default=str(default_out("0.6B")))
    p.add_argument("--tokens", type=int, default=128)
    args = p.parse_args(argv)
    torch.set_grad_enabled(False)
    model = load_model(args.checkpoint, "cpu", "bfloat16", optimize="decode")
    ids = torch.randint(0, model.config.vocab_size, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    bf16 = model(ids).float()[0]  # (T, V)
    del model
    int8 = load_model(args.checkpoint, "cpu", "bfloat16", optimize="decode", quantize="int8")(ids).float()[0]
    agree = (bf16.argmax(-1) == int8.argmax(-1)).float().mean().item()
    worst = ((int8 - bf16).abs().max() / bf16.abs().max()).item()
    per_row = ((int8 - bf16).abs().amax(-1) / bf16.abs().amax(-1)).median().item()
    print(f"{args.checkpoint}: {args.tokens} positions; int8 vs bf16 argmax agreement {agree:.1%}, "
          f"max |Δlogit| / max |logit| {worst:.4f} (median per position {per_row:.4f})")


if __name__ == "__main__":
    main()
