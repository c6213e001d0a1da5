"""What int4 weights cost in accuracy, and why they have zero points: on the exact Qwen3-0.6B shapes, argmax
agreement and logit error against the same model in bf16, over a random prompt, for each group size, with
the library's int4 (a scale and zero point per group, kernels/int4.py, through its kernel) and with
symmetric groups as llama.cpp's Q4_0 makes them (one scale per group, the largest-magnitude weight -> -8;
applied here as dequantized bf16 matrices).

    python scripts/int4_accuracy.py                      # weights/qwen3-0.6b-shapes, 64 positions

Random weights make the top logits near-ties and leave no structure for 4 bits to keep, so these figures
are far worse than a trained model's; they rank the schemes, nothing more. (int8: scripts/int8_accuracy.py.)
"""

import argparse
import sys
from pathlib import Path

import torch
from torch import nn

HERE = Path(__file__).resolve().parent
for folder in (HERE.parent, HERE):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

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


def compare(label: str, logits: torch.Tensor, bf16: torch.Tensor) -> None:
    agree = (bf16.argmax(-1) == logits.argmax(-1)).float().mean().item()
    worst = ((logits - bf16).abs().max() / bf16.abs().max()).item()
    rms = ((logits - bf16).pow(2).mean().sqrt() / bf16.pow(2).mean().sqrt()).item()
    print(f"| {label} | {agree:.1%} | {worst:.3f} | {rms:.3f} |", flush=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", default=str(default_out("0.6B")))
    p.add_argument("--tokens", type=int, default=64)
    args = p.parse_args(argv)
    torch.set_grad_enabled(False)
    model = load_model(args.checkpoint, "cpu", "bfloat16")
    ids = torch.randint(0, model.config.vocab_size, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    bf16 = model(ids).float()[0]  # (T, V)
    del model
    print(f"{args.checkpoint}, {args.tokens} positions, against bf16:\n")
    print("| int4 scheme | argmax agreement | max abs logit error / max abs logit | rms logit error / rms logit |")
    print("|---|---:|---:|---:|")
    for group_size in GROUP_SIZES:
        int4 = load_model(args.checkpoint, "cpu", "bfloat16", quantize="int4", quantize_group_size=group_size)
        compare(f"group {group_size}, scale + zero point (ours)", int4(ids).float()[0], bf16)
        del int4
        compare(f"group {group_size}, symmetric (Q4_0's rounding)", symmetric_model(args.checkpoint, group_size)(ids).float()[0], bf16)


if __name__ == "__main__":
    main()
