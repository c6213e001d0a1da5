"""What the tiny trained Qwen3 can do, measured on questions it never saw, in bf16 and quantized.

    python scripts/tiny/eval_tiny.py                                     # weights/tiny-qwen3-trained: bf16, int8 and int4
    python scripts/tiny/eval_tiny.py --checkpoint /tmp/tiny --schemes none --per-family 20

Every question is drawn from the held-out tenth of its family (tiny_tasks.is_held_out) and answered greedily:
  - accuracy per exercise family, thinking on and off: the reply's answer (tiny_tasks.read_answer) equals
    the expected value; with thinking on, "reasoned" is the share of replies with a non-empty <think>;
  - tool use: the share of calculator questions whose reply holds a tool call that
    `qwen3_scratch.text.chat_parser` accepts (well-formed), whose expression has the right value
    (correct call), and, once the true result is handed back as the tool's reply, a correct final answer;
  - perplexity on held-out standard-library text (files the training never read), per token of this BPE;
  - the draft's acceptance rate (--draft): along the target's greedy reply to held-out questions, the share
    of positions where the draft's argmax equals the target's token, and the tokens a greedy speculative
    step would make per target forward with k = 4 drafted tokens.
Each scheme (none = the checkpoint's bf16, int8, int4 where kernels/ has it) loads the same checkpoint with
`load_model(quantize=...)`; the table gives its figures and their difference from bf16.
"""

import argparse
import math
import random
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
for folder in (HERE.parents[1], HERE):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

from tiny_corpus import text_pieces  # noqa: E402
from tiny_tasks import CALCULATOR, FAMILIES, calculate, exercise, read_answer, tool_call_ok  # noqa: E402

from qwen3_scratch.checkpoint.weights import load_model  # noqa: E402
from qwen3_scratch.generation.loops import generate_tokens  # noqa: E402
from qwen3_scratch.kernels.layout import SCHEMES  # noqa: E402
from qwen3_scratch.text.chat_parser import parse_assistant, prompt_opens_thinking  # noqa: E402
from qwen3_scratch.text.tokenizer import Tokenizer  # noqa: E402

MAX_NEW_TOKENS = 200  # the longest working (a six-number sort) is ~130 tokens


def greedy_replies(model, tokenizer: Tokenizer, prompts: list[list[int]], batch_size: int = 32) -> list[list[int]]:
    """Each prompt's greedy continuation up to and including <|im_end|>, in batches of left-padded rows."""
    eos = [tokenizer.token_to_id("<|im_end|>"), tokenizer.token_to_id("<|endoftext|>")]
    replies = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        rows = [[] for _ in chunk]
        for step in generate_tokens(model, chunk, MAX_NEW_TOKENS, eos_ids=eos, pad_id=eos[1]):
            for row, token in zip(rows, step.tolist()):
                if token >= 0:
                    row.append(token)
        replies += rows
    return replies


def parsed(tokenizer, prompt, reply) -> dict:
    return parse_assistant(reply, tokenizer, in_reasoning=prompt_opens_thinking(prompt, tokenizer))


def exercise_scores(model, tokenizer, family: str, thinking: bool, n: int, seed: int) -> dict:
    rng = random.Random(f"{seed} {family}")  # the same questions for every scheme and both switches
    tasks = [exercise(family, rng, held_out=True) for _ in range(n)]
    prompts = [tokenizer.chat_ids([{"role": "user", "content": t.question}], enable_thinking=thinking) for t in tasks]
    messages = [parsed(tokenizer, p, r) for p, r in zip(prompts, greedy_replies(model, tokenizer, prompts))]
    right = sum(read_answer(family, m["content"]) == t.expected for m, t in zip(messages, tasks))
    reasoned = sum(bool(m["reasoning_content"]) for m in messages)
    return {"accuracy": right / n, "reasoned": reasoned / n}


def tool_scores(model, tokenizer, n: int, seed: int) -> dict:
    rng = random.Random(f"{seed} tool")
    tasks = [exercise("tool", rng, held_out=True) for _ in range(n)]
    asks = [[{"role": "user", "content": t.question}] for t in tasks]
    prompts = [tokenizer.chat_ids(a, tools=[CALCULATOR]) for a in asks]
    calls = [parsed(tokenizer, p, r) for p, r in zip(prompts, greedy_replies(model, tokenizer, prompts))]
    checks = [tool_call_ok(call, t.expected) for call, t in zip(calls, tasks)]
    # The second turn: the model's own call answered with the true result, whatever the call computed.
    expression = lambda t: t.key.removeprefix("tool ")  # noqa: E731
    follow = [a + [{k: v for k, v in c.items() if k != "tool_call_errors"},
                   {"role": "tool", "content": f'{{"result": {calculate(expression(t))}}}'}]
              for a, c, t in zip(asks, calls, tasks)]  # fmt: skip
    prompts = [tokenizer.chat_ids(f, tools=[CALCULATOR]) for f in follow]
    finals = [parsed(tokenizer, p, r) for p, r in zip(prompts, greedy_replies(model, tokenizer, prompts))]
    answered = sum(read_answer("tool", m["content"]) == t.expected for m, t in zip(finals, tasks))
    return {"well_formed": sum(w for w, _ in checks) / n, "correct_call": sum(c for _, c in checks) / n,
            "answered": answered / n}  # fmt: skip


@torch.no_grad()
def perplexity(model, tokenizer, max_tokens: int = 20_000, window: int = 512) -> float:
    """exp(mean next-token loss) over held-out standard-library text, in windows of `window` tokens."""
    eos, nll, count = tokenizer.token_to_id("<|endoftext|>"), 0.0, 0
    for piece in text_pieces(held_out=True):
        ids = tokenizer.encode(piece, split_special_tokens=True) + [eos]
        for start in range(0, len(ids) - 1, window):
            chunk = torch.tensor([ids[start : start + window + 1]])  # (1, <= window + 1)
            logits = model(chunk[:, :-1]).float()  # (1, T, V)
            nll += torch.nn.functional.cross_entropy(logits[0], chunk[0, 1:], reduction="sum").item()
            count += chunk.shape[1] - 1
        if count >= max_tokens:
            break
    return math.exp(nll / count)


@torch.no_grad()
def acceptance(target, draft, tokenizer, n: int, seed: int, k: int = 4) -> dict:
    """Greedy draft acceptance along the target's own greedy replies (see the module docstring)."""
    rng = random.Random(f"{seed} draft")
    questions = [exercise(rng.choice(list(FAMILIES)), rng, held_out=True).question for _ in range(n)]
    prompts = [tokenizer.chat_ids([{"role": "user", "content": q}]) for q in questions]
    agree, total, made, forwards = 0, 0, 0, 0
    for prompt, reply in zip(prompts, greedy_replies(target, tokenizer, prompts)):
        ids = torch.tensor([prompt + reply])  # (1, P + R)
        guesses = draft(ids).argmax(-1)[0, len(prompt) - 1 : -1]  # (R,): the draft's next token at each step
        hits = (guesses == ids[0, len(prompt) :]).tolist()
        agree, total = agree + sum(hits), total + len(hits)
        i = 0
        while i < len(hits):  # one speculative step: the accepted run of up to k drafts, plus the target's token
            run = next((j for j in range(min(k, len(hits) - i)) if not hits[i + j]), min(k, len(hits) - i))
            made, forwards, i = made + min(run + 1, len(hits) - i), forwards + 1, i + run + 1
    return {"acceptance": agree / total, "tokens_per_forward": made / forwards, "k": k}


def evaluate(checkpoint, scheme: str | None, per_family: int, seed: int, text_tokens: int) -> dict:
    torch.manual_seed(seed)
    model = load_model(checkpoint, "cpu", "bfloat16", quantize=scheme)
    tokenizer = Tokenizer.from_checkpoint(checkpoint)
    results = {f"{family} {'on' if thinking else 'off'}": exercise_scores(model, tokenizer, family, thinking, per_family, seed)
               for family in FAMILIES for thinking in (True, False)}  # fmt: skip
    results["tool"] = tool_scores(model, tokenizer, per_family, seed)
    results["perplexity"] = perplexity(model, tokenizer, text_tokens)
    return results


def table(results: dict[str, dict]) -> str:
    """Markdown: one row per measure, one column per scheme, quantized columns with their change from bf16."""
    schemes = list(results)
    base = results[schemes[0]]
    header = "| | " + " | ".join(schemes) + " |\n|---|" + "---:|" * len(schemes)
    rows = []
    for name, value in base.items():
        if name == "perplexity":
            cells = [f"{results[s]['perplexity']:.2f}" + (f" ({results[s]['perplexity'] - value:+.2f})" if s != schemes[0] else "")
                     for s in schemes]  # fmt: skip
            rows.append(f"| held-out text perplexity | {' | '.join(cells)} |")
            continue
        for measure in value:
            cells = [f"{results[s][name][measure]:.0%}" + (f" ({100 * (results[s][name][measure] - value[measure]):+.0f})"
                     if s != schemes[0] else "") for s in schemes]  # fmt: skip
            rows.append(f"| {name}: {measure.replace('_', ' ')} | {' | '.join(cells)} |")
    return "\n".join([header, *rows])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", default="weights/tiny-qwen3-trained", help="the trained target (default %(default)s)")
    p.add_argument("--draft", default=None, help="its draft, for the acceptance rate (default: CHECKPOINT-draft if it exists)")
    p.add_argument("--schemes", default=",".join(["none", *SCHEMES]), help="bf16 ('none') and quantizations (default %(default)s)")
    p.add_argument("--per-family", type=int, default=100, help="held-out questions per family and switch (default %(default)s)")
    p.add_argument("--text-tokens", type=int, default=20_000, help="held-out text tokens for perplexity (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="which held-out questions (default %(default)s)")
    args = p.parse_args(argv)
    torch.set_grad_enabled(False)
    results = {}
    for scheme in args.schemes.split(","):
        name = "bf16" if scheme == "none" else scheme
        results[name] = evaluate(args.checkpoint, None if scheme == "none" else scheme, args.per_family, args.seed,
                                 args.text_tokens)  # fmt: skip
    print(table(results))
    draft = Path(args.draft or f"{args.checkpoint.rstrip('/')}-draft")
    if draft.exists():
        tokenizer = Tokenizer.from_checkpoint(args.checkpoint)
        target, drafter = (load_model(path, "cpu", "bfloat16") for path in (args.checkpoint, draft))
        a = acceptance(target, drafter, tokenizer, args.per_family, args.seed)
        print(f"\ndraft {draft}: greedy acceptance {a['acceptance']:.1%} along the target's replies; "
              f"{a['tokens_per_forward']:.2f} tokens per target forward with k = {a['k']}")


if __name__ == "__main__":
    main()
