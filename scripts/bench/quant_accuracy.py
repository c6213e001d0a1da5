"""What quantized weights cost in accuracy, on the exact Qwen3-0.6B shapes: argmax agreement and logit error
against the same model in bf16, over one random prompt, for every scheme in one table:

  - int8: the library's int8 (one scale per output row, kernels/quantize.py), through its kernel;
  - int4 per group size: the library's int4 (a scale and zero point per group, kernels/int4.py), through its
    kernel, and symmetric groups as llama.cpp's Q4_0 makes them (one scale per group, the largest-magnitude
    weight -> -8; applied here as dequantized bf16 matrices): why ours has zero points.

    python scripts/bench/quant_accuracy.py                          # weights/qwen3-0.6b-shapes, 64 positions
    python scripts/bench/quant_accuracy.py --schemes int8 --tokens 128

Random weights make the top logits near-ties and leave no structure for 4 bits to keep, so these figures
are far worse than a trained model's; they rank the schemes, nothing more. (The tiny checkpoint's int8
figures are printed by tests/test_decode_layouts.py; the trained tiny model's accuracy by scripts/tiny/eval_tiny.py.)
"""

import argparse
import sys
from pathlib import Path

import torch
from torch import nn

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
for folder in (ROOT, HERE, ROOT / "scripts" / "checkpoints"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

from machine import Table, machine, machine_line  # noqa: E402
from make_shape_checkpoint import default_out  # noqa: E402

from qwen3_scratch.checkpoint.weights import load_model  # noqa: E402
from qwen3_scratch.kernels.int4 import GROUP_SIZES  # noqa: E402


def symmetric(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    """Q4_0's rounding, dequantized: per group d = (the weight of largest magnitude) / -8, q = round(w / d) + 8
    in [0, 15], w ~ (q - 8) * d, d kept in bf16. (N, K) -> (N, K) in weight's dtype."""
    N, K = weight.shape
    groups = weight.float().view(N, K // group_size, group_size)  # (N, K/g, g)
    extreme = groups.gather(-1, groups.abs().argmax(-1, keepdim=True))  # (N, K/g, 1)
    d = (extreme / -8).to(torch.bfloat16).float()
    q = (groups / torch.where(d == 0, 1, d) + 8).round().clamp(0, 15)
    return ((q - 8) * d).view(N, K).to(weight.dtype)


@torch.no_grad()
def symmetric_model(checkpoint, group_size: int):
    """The bf16 model with every matrix (and an untied copy of the tied lm_head) replaced by its Q4_0-style
    dequantized self, in chunks of rows (the lm_head's fp32 temporaries would be 0.6 GB at once)."""
    model = load_model(checkpoint, "cpu", "bfloat16")
    if model.lm_head.weight is model.model.embed_tokens.weight:
        model.lm_head = nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=False, device="meta")
        model.lm_head.weight = model.model.embed_tokens.weight
    for module in model.modules():
        if type(module) is nn.Linear:
            w = module.weight
            module.weight = nn.Parameter(torch.cat([symmetric(w[i : i + 8192], group_size) for i in range(0, len(w), 8192)]),
                                         requires_grad=False)  # fmt: skip
    return model


SCHEMES = ("int8", "int4", "q4_0")


def compare(table: Table, label: str, logits: torch.Tensor, bf16: torch.Tensor) -> None:
    agree = (bf16.argmax(-1) == logits.argmax(-1)).float().mean().item()
    worst = ((logits - bf16).abs().max() / bf16.abs().max()).item()
    rms = ((logits - bf16).pow(2).mean().sqrt() / bf16.pow(2).mean().sqrt()).item()
    table.row(label, f"{agree:.1%}", f"{worst:.3f}", f"{rms:.3f}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", default=str(default_out("0.6B")))
    p.add_argument("--tokens", type=int, default=64, help="positions of the random prompt (default 64)")
    p.add_argument("--schemes", default=",".join(SCHEMES), help=f"comma-separated, of {', '.join(SCHEMES)} (default all)")
    args = p.parse_args(argv)
    schemes = args.schemes.split(",")
    if unknown := sorted(set(schemes) - set(SCHEMES)):
        p.error(f"--schemes: unknown {unknown}; choose from {', '.join(SCHEMES)}")
    torch.set_grad_enabled(False)
    model = load_model(args.checkpoint, "cpu", "bfloat16")
    ids = torch.randint(0, model.config.vocab_size, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    bf16 = model(ids).float()[0]  # (T, V)
    del model
    print(machine_line(machine()))
    print(f"{args.checkpoint}, {args.tokens} positions, against bf16:\n")
    table = Table("scheme", "argmax agreement", "max abs logit error / max abs logit", "rms logit error / rms logit")
    if "int8" in schemes:
        int8 = load_model(args.checkpoint, "cpu", "bfloat16", optimize="decode", quantize="int8")
        compare(table, "int8, a scale per row (ours)", int8(ids).float()[0], bf16)
        del int8
    for group_size in GROUP_SIZES:
        if "int4" in schemes:
            int4 = load_model(args.checkpoint, "cpu", "bfloat16", quantize="int4", quantize_group_size=group_size)
            compare(table, f"int4, group {group_size}, scale + zero point (ours)", int4(ids).float()[0], bf16)
            del int4
        if "q4_0" in schemes:
            q4_0 = symmetric_model(args.checkpoint, group_size)(ids).float()[0]
            compare(table, f"int4, group {group_size}, symmetric (Q4_0's rounding)", q4_0, bf16)


if __name__ == "__main__":
    main()
