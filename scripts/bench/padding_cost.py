"""What padding every step to a bucket costs (engine/buckets.py): the same workload through the engine with the
step shapes padded and exact, alternating in one process, medians.

    python scripts/bench/padding_cost.py --checkpoint weights/qwen3-0.6b-shapes --threads 2 --repeats 3

Exact is the engine as it was before the buckets: prompt and speculative steps at their own token count,
prompt rows at their own queries and keys (decode-only steps keep their row buckets in both). Two workloads:
"burst", every request at once (a few prefill steps, then decode steps of all rows: benchmark_serving.py's
engine), and "staggered", a request every other step (most steps mix a prompt chunk with the decodes, where
the padding is). Each variant runs once unmeasured first, so both have met their shapes before they are timed
(in serving, the exact variant keeps meeting new ones: that cost is not counted here).
"""

import argparse
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from qwen3_scratch.checkpoint.placement import pick_dtype  # noqa: E402
from qwen3_scratch.checkpoint.weights import load_model  # noqa: E402
from qwen3_scratch.engine import model_runner  # noqa: E402
from qwen3_scratch.engine.engine import LLMEngine  # noqa: E402
from qwen3_scratch.sampling.params import SamplingParams  # noqa: E402


@contextmanager
def exact_shapes(exact: bool):
    """Within it, the runner pads no step (padded_size is the identity), if exact. Prompt rows' attention is
    never padded (engine/packed_view.py's prompt_row says why)."""
    saved = model_runner.padded_size
    if exact:
        model_runner.padded_size = lambda n: n
    try:
        yield
    finally:
        model_runner.padded_size = saved


def prompts(n, low, high, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high + 1, (n,), generator=g).tolist()
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for length in lengths]


def run(model, requests, new_tokens, every: int) -> float:
    """Output tokens/s with a request added every `every` steps (0: all at once)."""
    engine = LLMEngine(model, None, [], num_blocks=len(requests) * 16, block_size=16, max_num_seqs=len(requests))
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    pending, steps, count = list(enumerate(requests)), 0, 0
    start = time.perf_counter()
    while pending or engine.has_unfinished():
        while pending and (every == 0 or steps % every == 0):
            i, ids = pending.pop(0)
            engine.add_request(str(i), ids, params)
            if every:
                break
        count += sum(len(out.new_token_ids) for out in engine.step())
        steps += 1
    return count / (time.perf_counter() - start)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", default=str(ROOT / "weights" / "qwen3-0.6b-shapes"))
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt-tokens", default="17,129", help="prompt lengths, uniform in [low, high]")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    torch.set_grad_enabled(False)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_model(args.checkpoint, dtype=pick_dtype("auto", "cpu"), optimize="batch")  # the layout LLM loads
    low, high = (int(x) for x in args.prompt_tokens.split(","))
    requests = prompts(args.requests, low, high, model.config.vocab_size)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    print(f"{cpu}, {torch.get_num_threads()} threads, {model.activation_dtype}", flush=True)
    for workload, every in (("burst", 0), ("staggered", 2)):
        rates = {"padded": [], "exact": []}
        for repeat in range(args.repeats + 1):  # the first round unmeasured: both meet their shapes
            for variant in (("padded", "exact") if repeat % 2 == 0 else ("exact", "padded")):
                with exact_shapes(variant == "exact"):
                    rate = run(model, requests, args.new_tokens, every)
                if repeat:
                    rates[variant].append(rate)
        padded, exact = (statistics.median(rates[v]) for v in ("padded", "exact"))
        print(f"{workload}: padded {padded:.1f} tok/s, exact {exact:.1f} tok/s, padded / exact {padded / exact:.3f} "
              f"(runs: padded {[round(r, 1) for r in rates['padded']]}, exact {[round(r, 1) for r in rates['exact']]})",
              flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
