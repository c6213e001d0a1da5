"""Serving throughput and latency: the engine's continuous batching against one request at a time and
against transformers' `generate` on static batches, on the same prompts, in one run.

    python scripts/checkpoints/make_shape_checkpoint.py --size 0.6B          # once: weights/qwen3-0.6b-shapes
    python scripts/bench/benchmark_serving.py                            # -> docs/benchmarks/serving_cpu_0.6B.json

Every run generates exactly --new-tokens per request (EOS ignored), greedy, from random prompt ids.
Reported: output tokens/s at each concurrency; TTFT and time per output token (p50/p90) per request,
all requests arriving at once; the TTFT of a request whose --prefix-tokens system prompt is already in
the prefix cache against one whose is not; and one decode step of 16 rows x 512 tokens through the
paged cache (read in place where the engine does that, and with a gather per layer) against the same
step on a contiguous static cache.
"""

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from qwen3_scratch.checkpoint.placement import pick_dtype  # noqa: E402
from qwen3_scratch.checkpoint.weights import load_model  # noqa: E402
from qwen3_scratch.engine.engine import LLMEngine  # noqa: E402
from qwen3_scratch.engine.model_runner import ModelRunner  # noqa: E402
from qwen3_scratch.engine.paged_cache import PagedKVCache  # noqa: E402
from qwen3_scratch.engine.scheduler import Chunk, Sequence  # noqa: E402
from qwen3_scratch.generation.loops import CachedLoop, PaddedBatch, generate_tokens  # noqa: E402
from qwen3_scratch.sampling.logits import LogitsFilter  # noqa: E402
from qwen3_scratch.sampling.params import SamplingParams  # noqa: E402


def random_prompts(n, low, high, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high + 1, (n,), generator=g).tolist()
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for length in lengths]


def one_at_a_time(model, prompts, new_tokens):
    """The simple KV-cache loop, one request after another: output tokens/s."""
    start = time.perf_counter()
    for ids in prompts:
        for _ in generate_tokens(model, [ids], new_tokens, LogitsFilter(temperature=0.0)):
            pass
    return len(prompts) * new_tokens / (time.perf_counter() - start)


def run_engine(engine, prompts, new_tokens):
    """All requests arrive at once; returns output tokens/s and per-request (ttft, tpot) in seconds."""
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, params)
    first, last, count = {}, {}, 0
    while engine.has_unfinished():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            first.setdefault(out.request_id, now)
            last[out.request_id] = now
            count += 1
    elapsed = time.perf_counter() - start
    ttft = [first[r] - start for r in first]
    tpot = [(last[r] - first[r]) / (new_tokens - 1) for r in first]
    return count / elapsed, ttft, tpot


def percentiles(values):
    ordered = sorted(values)
    pick = lambda q: ordered[min(int(q * len(ordered)), len(ordered) - 1)]  # noqa: E731
    return {"p50": round(pick(0.5), 4), "p90": round(pick(0.9), 4)}


def prefix_effect(model, prefix_tokens, suffix_tokens, vocab, repeats):
    """TTFT of a request whose shared system prompt is cached (hit) against one whose is not (miss)."""
    misses, hits = [], []
    for r in range(repeats):
        engine = LLMEngine(model, None, [], num_blocks=-(-(prefix_tokens + 4 * suffix_tokens) // 16) * 2, block_size=16)
        prefix = random_prompts(1, prefix_tokens, prefix_tokens, vocab, seed=100 + r)[0]
        for store, seed in ((misses, 200 + r), (hits, 300 + r)):
            suffix = random_prompts(1, suffix_tokens, suffix_tokens, vocab, seed=seed)[0]
            _, ttft, _ = run_engine(engine, [prefix + suffix], 2)
            store.append(ttft[0])
    return statistics.median(misses), statistics.median(hits)


def paged_vs_contiguous(model, batch, context, repeats=5):
    """One decode step for `batch` rows at `context` tokens, seconds (best of `repeats`, the three
    alternating): the engine's paged step (in place where the engine does that), the same step
    gathering each row's blocks, and the contiguous static cache of the simple loop.

    The caches hold zeros instead of a prefill's keys: the timing does not depend on their values."""
    engine = LLMEngine(model, None, [], num_blocks=batch * (context // 16 + 2), block_size=16)
    gather = ModelRunner(model, PagedKVCache(model.config, engine.cache.num_blocks, 16, dtype=model.activation_dtype,
                                             in_place=False))  # fmt: skip
    prompts = random_prompts(batch, context + 1, context + 1, model.config.vocab_size, seed=7)
    chunks = []
    for i, ids in enumerate(prompts):
        seq = Sequence(str(i), ids, len(ids), SamplingParams(), 4, frozenset())
        seq.block_table, _ = engine.blocks.allocate(ids)
        chunks.append(Chunk(seq, context, context + 1))  # the newest token, after `context` cached ones
    loop = CachedLoop(model, PaddedBatch.left_pad([ids[:context] for ids in prompts], 0, "cpu"), repeats + 2)
    tokens = torch.zeros(batch, dtype=torch.long)
    steps = {"paged": lambda: engine.runner.decode(chunks), "paged_gather": lambda: gather.decode(chunks),
             "contiguous": lambda: loop.step(tokens)}  # the contiguous context grows by 1 a step  # fmt: skip
    for step in steps.values():
        step()  # warm: oneDNN's kernels for these shapes
    times = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            times[name].append(timed(step))
    return {name: min(t) for name, t in times.items()}


def timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def transformers_static(checkpoint, prompts, new_tokens, batch_size, dtype):
    """transformers' generate on static, left-padded batches of the same prompts: output tokens/s."""
    import transformers

    model = transformers.Qwen3ForCausalLM.from_pretrained(checkpoint, dtype=getattr(torch, dtype)).eval()
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        group = prompts[i : i + batch_size]
        batch = PaddedBatch.left_pad(group, 0, "cpu")
        model.generate(batch.ids, attention_mask=batch.valid.long(), max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)  # fmt: skip
    rate = len(prompts) * new_tokens / (time.perf_counter() - start)
    del model
    gc.collect()
    return rate


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Continuous batching vs one-at-a-time vs transformers' static batches.")
    p.add_argument("--checkpoint", default=str(ROOT / "weights" / "qwen3-0.6b-shapes"))
    p.add_argument("--requests", type=int, default=16, help="requests per concurrency level")
    p.add_argument("--single-requests", type=int, default=4, help="requests timed one at a time (its rate is per token)")
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--prompt-tokens", default="32,128", help="prompt lengths, uniform in [low, high]")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--prefix-tokens", type=int, default=1000, help="shared system prompt for the prefix-cache test")
    p.add_argument("--prefix-repeats", type=int, default=2)
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--dtype", default="auto", help="auto: what LLM picks on this CPU (checkpoint.placement.pick_dtype); both engines use it")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default: torch's); 1 avoids barrier stalls on a busy machine")
    p.add_argument("--out", default=str(ROOT / "docs" / "benchmarks" / "serving_cpu_0.6B.json"))
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    torch.set_grad_enabled(False)
    if args.threads:
        torch.set_num_threads(args.threads)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    info = {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "load_average_at_start": os.getloadavg()}  # fmt: skip
    print(f"machine: {info}\ncommand: python scripts/bench/benchmark_serving.py {' '.join(argv or sys.argv[1:])}", flush=True)
    dtype = pick_dtype(args.dtype, "cpu")
    info["dtype"] = dtype
    model = load_model(args.checkpoint, dtype=dtype, optimize="batch")  # the layout LLM loads
    vocab = model.config.vocab_size
    low, high = (int(x) for x in args.prompt_tokens.split(","))
    prompts = random_prompts(args.requests, low, high, vocab)
    report = {"machine": info, "args": vars(args), "tokens_per_second": {}, "latency": {}}
    rate = one_at_a_time(model, prompts[: args.single_requests], args.new_tokens)
    report["tokens_per_second"]["one_at_a_time"] = round(rate, 2)
    print(f"one at a time (simple loop): {rate:.2f} tok/s", flush=True)
    for c in (int(x) for x in args.concurrency.split(",")):
        engine = LLMEngine(model, None, [], num_blocks=c * (-(-(high + args.new_tokens) // 16) + 1) + 1,
                           block_size=16, max_num_seqs=c)  # fmt: skip
        subset = prompts[: args.single_requests] if c == 1 else prompts
        rate, ttft, tpot = run_engine(engine, subset, args.new_tokens)
        report["tokens_per_second"][f"engine_{c}"] = round(rate, 2)
        report["latency"][f"engine_{c}"] = {"ttft_s": percentiles(ttft), "tpot_s": percentiles(tpot)}
        print(f"engine, {c} concurrent: {rate:.2f} tok/s, ttft {percentiles(ttft)}, tpot {percentiles(tpot)}", flush=True)
    step = paged_vs_contiguous(model, 16, 512)
    report["decode_step_16x512_s"] = {name: round(t, 4) for name, t in step.items()}
    report["decode_step_16x512_s"]["paged_over_contiguous"] = round(step["paged"] / step["contiguous"], 3)
    print(f"decode step, 16 rows at 512 tokens: paged {step['paged'] * 1000:.1f} ms (gathering: "
          f"{step['paged_gather'] * 1000:.1f}), contiguous {step['contiguous'] * 1000:.1f} ms, "
          f"paged / contiguous {step['paged'] / step['contiguous']:.2f}", flush=True)  # fmt: skip
    miss, hit = prefix_effect(model, args.prefix_tokens, 16, vocab, args.prefix_repeats)
    report["prefix_cache_ttft_s"] = {"miss": round(miss, 4), "hit": round(hit, 4), "hit_over_miss": round(hit / miss, 4)}
    print(f"TTFT with a {args.prefix_tokens}-token shared prompt: miss {miss:.3f} s, hit {hit:.3f} s", flush=True)
    del model
    gc.collect()
    if not args.skip_transformers:
        for c in (int(x) for x in args.concurrency.split(",")):
            subset = prompts[: args.single_requests] if c == 1 else prompts
            rate = transformers_static(args.checkpoint, subset, args.new_tokens, c, dtype)
            report["tokens_per_second"][f"transformers_static_{c}"] = round(rate, 2)
            print(f"transformers generate, static batches of {c}: {rate:.2f} tok/s", flush=True)
    report["machine"]["load_average_at_end"] = os.getloadavg()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
