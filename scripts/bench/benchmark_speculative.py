"""Speculative decoding on the CPU: what checking k+1 tokens costs, what a draft costs, and tokens/s
against plain decoding as a function of the acceptance rate; prompt lookup on a quoting workload.

    python scripts/bench/benchmark_speculative.py --out docs/benchmarks/speculative_cpu.json     # ~12 min
    python scripts/bench/benchmark_speculative.py --only costs          # the verification and draft costs only
    python scripts/bench/benchmark_speculative.py --only agreement      # bf16: speculative greedy vs plain greedy
    python scripts/bench/benchmark_speculative.py --quick --only draft  # the adaptive k's rows only (~3 min)
    python scripts/bench/benchmark_speculative.py --only fallback --repeats 5   # nothing kept: the cost of trying

The target has Qwen3-0.6B's exact shapes (random weights; make_shape_checkpoint.py writes it if missing),
in bf16 (this CPU's default) and the decode layout Pipeline loads it in. How the figures stay honest:

  - Acceptance. A random target agrees with no draft, so the target is *scripted*: a forward hook sets,
    at every position, the logit of the script's next token above all others (one scatter on the
    logits, paid by plain and speculative runs alike). Greedy decoding then produces the script, and
    a proposal is kept exactly when it is the script's token.
  - Draft cost. The draft is a real Qwen3 that runs a real forward for every token it proposes, over
    its own KV cache, rolled back like any draft's: Qwen3-0.6B's vocabulary, 4 layers of width 256
    (47.5M parameters: 1/12.5 of the target's bytes per token, the ratio of Qwen3-0.6B to Qwen3-8B).
    Only its choice is overruled: it proposes the script's token with probability a, else a wrong
    one, so the acceptance is the a we choose and the cost is a real small draft's. Its step time
    next to the target's is measured and printed ("draft_cost").
  - The self-draft (the target drafting for itself: ~100% acceptance at a full target step per
    proposal) is shown too: it never pays, which is what the adaptive k sees.
  - Prompt lookup needs no draft; the quoting workload's script is a code edit whose answer repeats
    the prompt's code with one name changed (tokenized with the tiny BPE), and its acceptance is what
    the real prompt lookup achieves on it. Two workloads where nothing is kept: no earlier match at all
    (random ids from the whole vocabulary), and matches whose continuations are wrong (random ids from
    64 values: ~1/64 kept).
  - Decode tokens/s (after the first token, as the stats line's decode_tokens_per_second), median of
    --repeats runs, the plain run (Pipeline's loop, loops.generate_tokens) repeated beside each
    configuration's, alternating; the speedup is the median of each run's ratio to its plain run. Speculation runs over chat's one-sequence cache (ConversationCache);
    plain decoding over that cache is measured too ("plain, chat's loop"), so that a speedup that
    comes from the loop rather than from speculation would show.
"""

import argparse
import json
import random
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

from machine import machine  # noqa: E402
from make_shape_checkpoint import default_out, make_shape_checkpoint  # noqa: E402

from qwen3_scratch.checkpoint.weights import load_model  # noqa: E402
from qwen3_scratch.generation.conversation import ConversationCache  # noqa: E402
from qwen3_scratch.generation.draft_model import DraftModel  # noqa: E402
from qwen3_scratch.generation.loops import generate_tokens  # noqa: E402
from qwen3_scratch.sampling.prompt_lookup import PromptLookup  # noqa: E402
from qwen3_scratch.generation.speculative import Speculator  # noqa: E402
from qwen3_scratch.generation.stats import SpeculationStats, measure_bandwidth  # noqa: E402
from qwen3_scratch.kernels.cpu_decode import CPUDecoderLayer  # noqa: E402
from qwen3_scratch.kernels.fewrow import FewRowDecoderLayer, FewRowLinear, use_fewrow  # noqa: E402
from qwen3_scratch.kernels.matvec import MatvecLinear  # noqa: E402
from qwen3_scratch.sampling.logits import LogitsFilter, sample  # noqa: E402
from qwen3_scratch.text.tokenizer import Tokenizer  # noqa: E402

GREEDY = LogitsFilter(temperature=0.0)
DRAFT_SHAPES = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4)  # 47.5M parameters
RATES = (0.0, 0.3, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)  # k = 4 every round
ADAPTIVE_RATES = (0.0, 0.5, 0.8)  # k <= 4, adaptive: the fallback where nothing is kept, and two rates
EDIT_CODE = '''def summarize(records, key):
    count = 0
    totals = {}
    for record in records:
        value = record.get(key)
        if value is None:
            continue
        count += 1
        totals[value] = totals.get(value, 0) + 1
    shares = {name: number / count for name, number in totals.items()}
    return count, sorted(shares.items(), key=lambda item: -item[1])
'''


def script(model, tokens: list[int]):
    """Make greedy decoding of `model` produce `tokens`: the token after position i is tokens[i + 1]."""
    table = torch.tensor(tokens)

    def hook(module, args, kwargs, logits):  # logits (B, T or 1, V); args[1]: positions (B, T)
        positions = args[1][:, -logits.shape[1] :]
        logits.scatter_(-1, table[positions + 1][..., None], 1e4)
        return logits

    return model.register_forward_hook(hook, with_kwargs=True)


class OracleDraft(DraftModel):
    """A real draft model's forwards and cache, proposing the script's token with probability `rate`."""

    def __init__(self, model, target, tokens: list[int], rate: float, seed: int = 0):
        super().__init__(model, target)
        self.tokens, self.rate, self.rng = tokens, rate, random.Random(seed)

    def propose(self, tokens, k, params=None, generator=None):
        if k < 1:
            return [], None
        logits = self.cache.prefill(tokens, reserve=k)
        proposed = []
        for i in range(k):
            int(logits.float().argmax())  # the draft's own choice, made as a real draft makes it, then overruled
            right = self.tokens[len(tokens) + i]
            proposed.append(right if self.rng.random() < self.rate else right + 1)
            if i + 1 < k:
                logits = self.cache.step(proposed[-1])
        return proposed, None


def plain_rate(model, prompt: list[int], n_new: int) -> float:
    """Decode tokens/s of plain greedy decoding (Pipeline's loop), after the first token."""
    steps = generate_tokens(model, [prompt], n_new, GREEDY)
    next(steps).tolist()
    start = time.perf_counter()
    made = sum(1 for step in steps if step.tolist())
    return made / (time.perf_counter() - start)


def chat_loop_rate(model, prompt: list[int], n_new: int) -> tuple[float, object]:
    """Decode tokens/s of plain greedy decoding over the cache speculation uses (chat's loop,
    Conversation.plain_tokens): shows how much of a speedup is the loop rather than speculation."""
    cache = ConversationCache(model)
    token = int(sample(cache.prefill(prompt, reserve=n_new), GREEDY))
    start = time.perf_counter()
    for _ in range(n_new - 1):
        token = int(sample(cache.step(token), GREEDY))
    return (n_new - 1) / (time.perf_counter() - start), SpeculationStats()


def spec_rate(model, proposer, prompt, n_new, k, adaptive, expected=None) -> tuple[float, object]:
    """Decode tokens/s of speculative greedy decoding after the first token, and its counts."""
    speculator = Speculator(proposer, k, adaptive)
    tokens = speculator.generate(ConversationCache(model), prompt, n_new, GREEDY)
    out = [next(tokens)]
    start = time.perf_counter()
    out += list(tokens)
    rate = (len(out) - 1) / (time.perf_counter() - start)
    if expected is not None:
        assert out == expected, "speculation changed the output"
    return rate, speculator.stats


def forward_time(cache: ConversationCache, rows: int) -> float:
    """Seconds of one forward over `rows` new tokens after the cache's 64-token context (what extend runs)."""
    start = time.perf_counter()
    cache.extend(list(range(2000, 2000 + rows)))
    elapsed = time.perf_counter() - start
    cache.truncate(64)
    return elapsed


def relative_cost(model, rows: int, base=None, repeats: int = 15) -> float:
    """Median over repeats of (a forward over `rows` tokens) / (a one-row forward of `base`, default the
    same model), each pair timed back to back, so that drifting machine load cancels."""
    caches = [ConversationCache(m) for m in (model, base or model)]
    for cache in caches:
        cache.prefill(list(range(1000, 1064)), reserve=16)
    ratios = []
    for i in range(repeats + 2):  # the first two warm up
        ratios.append(forward_time(caches[0], rows) / forward_time(caches[1], 1))
    return statistics.median(ratios[2:])


def set_fewrow(model, on: bool) -> None:
    """Few-row products through the packed copies (use_fewrow made them) or through F.linear."""
    for module in model.modules():
        if isinstance(module, MatvecLinear) and hasattr(module, "packed"):
            module.__class__ = FewRowLinear if on else MatvecLinear
        if isinstance(module, CPUDecoderLayer) and hasattr(module, "qkv_packed"):
            module.__class__ = FewRowDecoderLayer if on else CPUDecoderLayer


def costs(target, draft) -> dict:
    """Verification forwards of 2..9 rows next to a one-row step, with the packed few-row products and with F.linear;
    and a draft step next to a target step."""
    cache = ConversationCache(target)
    cache.prefill(list(range(1000, 1064)), reserve=16)
    one = statistics.median(forward_time(cache, 1) for _ in range(15))
    result = {"target_step_ms": round(one * 1e3, 1), "draft_cost": round(relative_cost(draft, 1, base=target), 3)}
    for kernel, on in (("fewrow", True), ("F.linear", False)):
        set_fewrow(target, on)
        result[f"verify_{kernel}"] = {rows: round(relative_cost(target, rows), 3) for rows in range(2, 10)}
    set_fewrow(target, True)
    return result


def alternate(configs: dict, plain, repeats: int) -> dict:
    """Each configuration's runs alternating with plain runs. tokens/s: medians; speedup: the median of
    each run's ratio to the plain run just before it, so that load drifting over the run cancels."""
    runs = {name: [] for name in configs} | {"plain": []}
    ratios = {name: [] for name in configs}
    counts = {}
    for _ in range(repeats):
        for name, run in configs.items():
            runs["plain"].append(plain())
            rate, counts[name] = run()
            runs[name].append(rate)
            ratios[name].append(rate / runs["plain"][-1])
    table = {"plain": {"tokens_per_s": round(statistics.median(runs["plain"]), 2)}}
    for name in configs:
        median, speedup = statistics.median(runs[name]), statistics.median(ratios[name])
        table[name] = {"tokens_per_s": round(median, 2), "speedup": round(speedup, 3),
                       "speedups": [round(r, 3) for r in ratios[name]],
                       "acceptance_rate": round(counts[name].acceptance_rate, 3),
                       # each forward makes its kept proposals and one token of its own
                       "tokens_per_forward": round((counts[name].accepted + counts[name].forwards)
                                                   / max(counts[name].forwards, 1), 2)}  # fmt: skip
        print(f"  {name:34s} {median:6.2f} tok/s  x{speedup:.3f} {table[name]['speedups']}  acceptance "
              f"{counts[name].acceptance_rate:.2f}", flush=True)
    return table


def draft_sweep(target, draft_folder, args) -> dict:
    """Tokens/s against the acceptance rate, k = 4 every round and adaptive, and the self-draft."""
    tokens = random.Random(1).choices(range(1000, 100_000), k=args.prompt_tokens + args.new_tokens + 32)
    handle = script(target, tokens)
    prompt, expected = tokens[: args.prompt_tokens], tokens[args.prompt_tokens : args.prompt_tokens + args.new_tokens]
    draft = load_model(draft_folder, "cpu", torch.bfloat16, optimize="decode")
    configs = {}
    rates = () if args.quick else RATES  # --quick: the adaptive rows and the chat loop only
    for rate, adaptive in [(rate, False) for rate in rates] + [(rate, True) for rate in ADAPTIVE_RATES]:
        name = f"draft a={rate:.2f} k={'<=4 adaptive' if adaptive else '4'}"
        configs[name] = (lambda rate=rate, adaptive=adaptive: spec_rate(
            target, OracleDraft(draft, target, tokens, rate), prompt, args.new_tokens, 4, adaptive, expected))
    configs["plain, chat's loop"] = lambda: chat_loop_rate(target, prompt, args.new_tokens)
    if not args.quick:
        configs["self-draft k=4"] = lambda: spec_rate(target, DraftModel(target, target), prompt, args.new_tokens, 4,
                                                      False, expected)  # fmt: skip
    table = alternate(configs, lambda: plain_rate(target, prompt, args.new_tokens), args.repeats)
    handle.remove()
    if args.quick:
        return table
    fixed = [table[f"draft a={rate:.2f} k=4"] for rate in RATES]
    table["break_even"] = {  # k = 4: by the draft's agreement a, and by the stats line's acceptance_rate
        "a": break_even({rate: row["speedup"] for rate, row in zip(RATES, fixed)}),
        "acceptance_rate": break_even({row["acceptance_rate"]: row["speedup"] for row in fixed}),
    }
    print(f"  break-even (k=4): {table['break_even']}", flush=True)
    return table


def break_even(speedups: dict[float, float]) -> float | None:
    """The acceptance rate where speedup crosses 1, interpolated linearly between the measured rates."""
    rates = sorted(speedups)
    for low, high in zip(rates, rates[1:]):
        if speedups[low] < 1 <= speedups[high]:
            return round(low + (high - low) * (1 - speedups[low]) / (speedups[high] - speedups[low]), 3)
    return None


def lookup_workloads(target, args) -> dict:
    """Prompt lookup on a code edit (the answer repeats the prompt), and on two texts where nothing is kept."""
    tokenizer = Tokenizer.from_checkpoint(ROOT / "weights" / "tiny-qwen3")
    prompt = tokenizer.encode(f"Rename count to seen in this function:\n```python\n{EDIT_CODE}```\n")
    answer = tokenizer.encode(f"```python\n{EDIT_CODE.replace('count', 'seen')}```\n")
    rng = random.Random(2)
    workloads = {
        "code edit (quoting)": prompt + answer,
        "no earlier match": rng.choices(range(1000, 150_000), k=len(prompt) + len(answer)),
        "wrong matches (64 ids)": rng.choices(range(1000, 1064), k=len(prompt) + len(answer)),
    }
    result = {}
    for name, tokens in workloads.items():
        n_new = min(len(answer), args.new_tokens)
        tokens = tokens + tokens[-1:] * 32
        handle = script(target, tokens)
        p, expected = tokens[: len(prompt)], tokens[len(prompt) : len(prompt) + n_new]
        configs = {f"ngram {name}": lambda: spec_rate(target, PromptLookup(), p, n_new, 4, True, expected)}
        result |= alternate(configs, lambda: plain_rate(target, p, n_new), args.repeats)
        handle.remove()
    return result


def fallback(target, draft_folder, args) -> dict:
    """Where nothing is kept, side by side in one alternation: chat's loop (no speculation), prompt lookup
    that finds no earlier match (so proposes nothing), and a draft that is always wrong (adaptive k)."""
    tokens = random.Random(3).choices(range(1000, 150_000), k=args.prompt_tokens + args.new_tokens + 32)
    handle = script(target, tokens)
    prompt = tokens[: args.prompt_tokens]
    expected = tokens[args.prompt_tokens : args.prompt_tokens + args.new_tokens]
    draft = load_model(draft_folder, "cpu", torch.bfloat16, optimize="decode")
    configs = {
        "plain, chat's loop": lambda: chat_loop_rate(target, prompt, args.new_tokens),
        "ngram, nothing proposed": lambda: spec_rate(target, PromptLookup(), prompt, args.new_tokens, 4, True, expected),
        "draft a=0.00 k=<=4 adaptive": lambda: spec_rate(target, OracleDraft(draft, target, tokens, 0.0), prompt,
                                                         args.new_tokens, 4, True, expected),  # fmt: skip
    }
    table = alternate(configs, lambda: plain_rate(target, prompt, args.new_tokens), args.repeats)
    handle.remove()
    return table


def agreement(args) -> dict:
    """bf16, unscripted: how often speculative greedy output equals plain greedy output, token for token."""
    result = {}
    for folder, prompts, n_new in ((ROOT / "weights" / "tiny-qwen3", 20, 64), (default_out("0.6B"), 6, 48)):
        model = load_model(folder, "cpu", torch.bfloat16, optimize="decode")
        vocab = model.config.vocab_size
        same, first_diff = 0, []
        for seed in range(prompts):
            prompt = random.Random(seed).choices(range(vocab - 300), k=32)
            plain = [t.item() for t in generate_tokens(model, [prompt], n_new, GREEDY)]
            spec = list(Speculator(DraftModel(model, model), 4, adaptive=False).generate(ConversationCache(model), prompt,
                                                                                        n_new, GREEDY))  # fmt: skip
            same += plain == spec
            first_diff.append(next((i for i, (a, b) in enumerate(zip(plain, spec)) if a != b), n_new))
        result[folder.name] = {"generations": prompts, "new_tokens": n_new, "identical": same,
                               "first_difference_median": statistics.median(first_diff)}  # fmt: skip
        print(f"  {folder.name}: {same}/{prompts} identical over {n_new} tokens; first difference at "
              f"token {statistics.median(first_diff)} (median)", flush=True)
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["costs", "draft", "ngram", "fallback", "agreement"], help="one part (default: all)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--quick", action="store_true", help="draft part: only the adaptive rows and the chat loop")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    target_folder = make_shape_checkpoint("0.6B")
    draft_folder = make_shape_checkpoint("0.6B", ROOT / "weights" / "qwen3-draft-256x4", seed=1, overrides=DRAFT_SHAPES)
    report = {"machine": machine("cpu", measure_bandwidth("cpu")), "command": " ".join(sys.argv)}
    print(report["machine"], flush=True)
    if args.only in (None, "agreement"):
        report["bf16_agreement"] = agreement(args)
    target = load_model(target_folder, "cpu", torch.bfloat16, optimize="decode")
    use_fewrow(target)  # what make_speculator does for Pipeline's target: the few-row products' packed copies
    if args.only in (None, "costs"):
        report["costs"] = costs(target, load_model(draft_folder, "cpu", torch.bfloat16, optimize="decode"))
        print(report["costs"], flush=True)
    if args.only in (None, "draft"):
        report["draft"] = draft_sweep(target, draft_folder, args)
    if args.only in (None, "ngram"):
        report["ngram"] = lookup_workloads(target, args)
    if args.only in (None, "fallback"):
        report["fallback"] = fallback(target, draft_folder, args)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
