"""Time to first token of a chat's turn N, with the KV cache kept across turns and without, side by side.

    python scripts/bench/benchmark_chat.py                         # Qwen3-0.6B shapes, CPU, fp32, turn 6
    python scripts/bench/benchmark_chat.py --turns 6 --user-tokens 48 --reply-tokens 64 --reasoning-tokens 32

The checkpoint has Qwen3-0.6B's exact shapes and random weights (scripts/checkpoints/make_shape_checkpoint.py writes it
if missing). It has no tokenizer, so the conversation is built in token ids with Qwen3's own control ids,
shaped the way Qwen3's template renders a chat: each turn adds a user message of --user-tokens random ids;
the model then generates --reply-tokens greedily (real decode steps through the cache); the next prompt
shows that reply with its first --reasoning-tokens dropped (Qwen3's template drops past reasoning), so the
new prompt is *not* an append of the cached tokens and reuse must go by the common prefix.

Turn N is then timed both ways on the same prompt (median of --repeats, alternating):
  - reuse: the cache as turn N-1 left it; only the tokens past the common prefix are prefilled;
  - no reuse: an empty cache; the whole prompt is prefilled (what a single-prompt API does every turn).
TTFT = prompt in, first token (argmax) out.

Shapes: V vocab.
"""

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
for folder in (ROOT, HERE, ROOT / "scripts" / "checkpoints"):  # run as a script from anywhere
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

from machine import Table, machine, machine_line  # noqa: E402
from make_shape_checkpoint import default_out, make_shape_checkpoint  # noqa: E402

from qwen3_scratch.checkpoint.weights import load_model  # noqa: E402
from qwen3_scratch.generation.conversation import ConversationCache, common_prefix_length  # noqa: E402

# Qwen3's control tokens and the ids of "user", "assistant" and "\n" in its vocabulary
IM_START, IM_END, THINK, END_THINK = 151644, 151645, 151667, 151668
USER, ASSISTANT, NEWLINE = 872, 77091, 198


def message(role: int, ids: list[int]) -> list[int]:
    return [IM_START, role, NEWLINE, *ids, IM_END, NEWLINE]


def build_history(cache: ConversationCache, turns: int, args, generator: torch.Generator) -> list[int]:
    """Play turns 1..turns-1 through the cache; return turn `turns`' prompt."""
    history: list[int] = []
    for turn in range(turns):
        user = torch.randint(1000, 100_000, (args.user_tokens,), generator=generator).tolist()
        history += message(USER, user)
        prompt = history + [IM_START, ASSISTANT, NEWLINE]
        if turn == turns - 1:
            return prompt
        logits = cache.prefill(prompt, reserve=args.reply_tokens + 2)  # (1, V)
        reply = [THINK]
        for _ in range(args.reply_tokens):  # <think> reasoning </think> answer, as the model would write it
            reply.append(int(logits.argmax()))
            if len(reply) == args.reasoning_tokens + 1:
                reply.append(END_THINK)
            logits = cache.step(reply[-1])
        history += message(ASSISTANT, reply[args.reasoning_tokens + 2 :])  # past reasoning is dropped


def ttft(cache: ConversationCache, prompt: list[int]) -> float:
    start = time.perf_counter()
    int(cache.prefill(prompt).argmax())  # the first token, on the host
    return time.perf_counter() - start


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, default=default_out("0.6B"))
    p.add_argument("--dtype", default="float32")
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--user-tokens", type=int, default=48)
    p.add_argument("--reply-tokens", type=int, default=64)
    p.add_argument("--reasoning-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    if not (args.model / "config.json").exists():
        make_shape_checkpoint("0.6B", args.model)
    model = load_model(args.model, device="cpu", dtype=args.dtype)
    cache = ConversationCache(model)
    prompt = build_history(cache, args.turns, args, torch.Generator().manual_seed(0))
    cached = len(cache.tokens)
    shared = min(common_prefix_length(cache.tokens, prompt), len(prompt) - 1)
    fresh = ConversationCache(model)
    ttft(fresh, prompt)  # warm-up: the first forward of this length allocates
    with_reuse, without = [], []
    for _ in range(args.repeats):
        cache.tokens = cache.tokens[:shared]  # back to what turn N-1 left valid (slots below stay intact)
        with_reuse.append(ttft(cache, prompt))
        fresh.reset()
        without.append(ttft(fresh, prompt))
    print(machine_line(machine()))
    print(f"{args.model.name}, {args.dtype}")
    print(f"turn {args.turns}: prompt {len(prompt)} tokens; the cache held {cached} (turn {args.turns - 1}'s prompt "
          f"and reply), {shared} of them shared with the new prompt")  # fmt: skip
    table = Table(f"turn {args.turns}", "tokens prefilled", "TTFT median (s)", "runs (s)")
    for name, runs, prefilled in (("reuse", with_reuse, len(prompt) - shared), ("no reuse", without, len(prompt))):
        table.row(name, prefilled, f"{statistics.median(runs):.3f}", ", ".join(f"{r:.3f}" for r in runs))
    print(f"speed-up: {statistics.median(without) / statistics.median(with_reuse):.1f}x")


if __name__ == "__main__":
    main()
