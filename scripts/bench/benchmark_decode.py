"""Decode speed, side by side: transformers' `generate`, our full-recompute loop, our KV-cache loop
(and the cache loop compiled, on GPU), on the same checkpoint and the same prompt.

    python scripts/bench/benchmark_decode.py                                   # Qwen3-0.6B shapes, CPU, fp32
    python scripts/bench/benchmark_decode.py --sizes 0.6B,1.7B,4B,8B --device cuda --engines transformers,recompute,cache,compiled

The checkpoints have the exact shapes of each Qwen3 size with random weights (written by
scripts/checkpoints/make_shape_checkpoint.py if missing): decode speed depends on the bytes and the matmul
sizes, not on what the weights say. Every engine generates a fixed number of tokens, greedily, with
EOS ignored, so all do the same work.

What is reported, per engine (median of --repeats timed runs, after one untimed warm-up run):
  - TTFT: prompt in, first token out (one host sync after the first token, none after the others);
  - decode tok/s: the tokens after the first / the time after the first;
  - the bandwidth limit: decode is memory-bound, every step reads every weight and the KV cache once,
    so no engine can beat  measured bandwidth / bytes per step; util is decode tok/s / that limit.
The sweep times one step at each context length L: recompute runs all L tokens again, the cache
runs one token against L cached ones, so the first grows with L and the second stays nearly flat.

Shapes: B batch (1 here), T prompt tokens, V vocab.
"""

import argparse
import gc
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
for folder in (ROOT, HERE, ROOT / "scripts" / "checkpoints"):  # run as a script from anywhere
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

from machine import machine, machine_line  # noqa: E402
from make_shape_checkpoint import default_out, make_shape_checkpoint  # noqa: E402

from qwen3_scratch.checkpoint.weights import load_model  # noqa: E402
from qwen3_scratch.generation.loops import CachedLoop, PaddedBatch, RecomputeLoop, generate_tokens  # noqa: E402
from qwen3_scratch.generation.stats import bytes_per_decode_step, measure_bandwidth, synchronize  # noqa: E402
from qwen3_scratch.model.config import DTYPES, Qwen3Config  # noqa: E402
from qwen3_scratch.sampling.logits import LogitsFilter  # noqa: E402

OURS = {  # our engines: generate_tokens arguments
    "recompute": dict(use_cache=False),
    "plain": dict(use_cache=True),
    "packed": dict(use_cache=True),
    "cache": dict(use_cache=True),
    "int8": dict(use_cache=True),
    "int4": dict(use_cache=True),
    "compiled": dict(use_cache=True, compile=True),
}
LAYOUTS = {  # load_model arguments: "plain" keeps the checkpoint's layout, "packed" is serving's (LLM's),
    "recompute": {}, "plain": {}, "packed": dict(optimize="batch"),  # the others load as the Pipeline does
    "cache": dict(optimize="decode"), "int8": dict(optimize="decode", quantize="int8"),
    "int4": dict(optimize="decode", quantize="int4"), "compiled": dict(optimize="decode"),
}  # fmt: skip
ENGINES = ("transformers", *OURS, "llamacpp")
QUANTIZED = ("int8", "int4")  # our engines whose weights are not in --dtype (their activations are)
GREEDY = LogitsFilter(temperature=0.0)
SWEEP_STEPS = 5  # decode steps timed per length; the median is kept
RECOMPUTE_SWEEP_REPEATS = 3  # a recompute step is one long forward, so fewer repeats suffice


# ---- one timed generation --------------------------------------------------------------------


@dataclass
class Run:
    new_tokens: int
    ttft_s: float  # prompt in -> first token on the host
    total_s: float  # prompt in -> last token on the host
    tokens: list[int] = field(repr=False)

    @property
    def decode_tok_s(self) -> float:  # batch 1: one token per step after the first
        return (self.new_tokens - 1) / (self.total_s - self.ttft_s)

    @property
    def overall_tok_s(self) -> float:
        return self.new_tokens / self.total_s


def time_ours(model, prompt: list[int], n: int, device, use_cache: bool, compile: bool = False) -> Run:
    """Consume our token iterator with a sync after the first token and at the end, none between."""
    synchronize(device)
    start = time.perf_counter()
    tokens = generate_tokens(model, [prompt], n, GREEDY, ignore_eos=True, use_cache=use_cache, compile=compile)
    out = [next(tokens)]
    synchronize(device)
    ttft = time.perf_counter() - start
    out.extend(tokens)  # stays on the device: no .item() per token
    synchronize(device)
    total = time.perf_counter() - start
    return Run(len(out), ttft, total, torch.cat(out).tolist())


class FirstTokenClock:
    """A transformers streamer that only notes when the first new token arrives (generate calls put()
    once with the prompt, then once per new token)."""

    def __init__(self, device, start: float):
        self.device, self.start, self.calls, self.ttft = device, start, 0, None

    def put(self, value):
        self.calls += 1
        if self.calls == 2:
            synchronize(self.device)
            self.ttft = time.perf_counter() - self.start

    def end(self):
        pass


def time_transformers(model, prompt: list[int], n: int, device) -> Run:
    """generate() with exactly n greedy tokens: min_new_tokens=n masks EOS, as --ignore-eos does for ours."""
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    ids = torch.tensor([prompt], device=device)
    synchronize(device)
    start = time.perf_counter()
    clock = FirstTokenClock(device, start)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config, streamer=clock)
    synchronize(device)
    total = time.perf_counter() - start
    new = out[0, len(prompt) :].tolist()
    return Run(len(new), clock.ttft, total, new)


def run_once(engine: str, model, prompt: list[int], n: int, device) -> Run:
    if engine == "transformers":
        return time_transformers(model, prompt, n, device)
    return time_ours(model, prompt, n, device, **OURS[engine])


def time_engine(engine: str, model, prompt, n: int, device, repeats: int, warmup_tokens: int) -> list[Run]:
    """One untimed warm-up run (allocator, kernels, compilation), then `repeats` timed runs."""
    run_once(engine, model, prompt, warmup_tokens, device)
    runs = []
    for i in range(repeats):
        runs.append(run_once(engine, model, prompt, n, device))
        print(f"  {engine} run {i + 1}/{repeats}: ttft {runs[-1].ttft_s:.3f} s, "
              f"decode {runs[-1].decode_tok_s:.2f} tok/s", flush=True)
    return runs


def median_run(runs: list[Run]) -> dict:
    """The median of each figure over the runs, and every run's decode speed for the record."""
    return {
        "new_tokens": runs[0].new_tokens,
        "ttft_s": statistics.median(r.ttft_s for r in runs),
        "decode_tok_s": statistics.median(r.decode_tok_s for r in runs),
        "overall_tok_s": statistics.median(r.overall_tok_s for r in runs),
        "decode_tok_s_all": [round(r.decode_tok_s, 3) for r in runs],
        "tokens": runs[-1].tokens,
    }


# ---- time per token against context length -------------------------------------------------------


def timed(fn, device) -> float:
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def sweep_recompute(model, prompt: list[int], device) -> float:
    """A recompute step at length L is one forward over all L tokens (only the last row's logits)."""
    batch = PaddedBatch.left_pad([prompt], 0, device)
    return statistics.median(timed(RecomputeLoop(model, batch).start, device) for _ in range(RECOMPUTE_SWEEP_REPEATS))


def sweep_cache(model, prompt: list[int], device) -> float:
    """Prefill L tokens into a cache, then time single decode steps against it."""
    loop = CachedLoop(model, PaddedBatch.left_pad([prompt], 0, device), SWEEP_STEPS + 1)
    token = loop.start().argmax(-1)  # (B,)
    times = []
    for _ in range(SWEEP_STEPS):
        times.append(timed(lambda: loop.step(token), device))
    return statistics.median(times)


def sweep_transformers(model, prompt: list[int], device) -> float:
    """The same for transformers, with its own (dynamic) cache via past_key_values."""
    out = model(torch.tensor([prompt], device=device), use_cache=True)
    cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)  # token (B, 1)
    times = []
    for _ in range(SWEEP_STEPS):
        times.append(timed(lambda: model(token, past_key_values=cache, use_cache=True), device))
    return statistics.median(times)


SWEEPS = {"transformers": sweep_transformers, "recompute": sweep_recompute, "cache": sweep_cache}


def sweep(engine: str, model, lengths: list[int], vocab: int, device) -> dict[int, float]:
    """Seconds per token at each context length; one short warm-up at the first length first."""
    fn = SWEEPS[engine]
    fn(model, random_prompt(min(lengths), vocab, seed=1), device)
    result = {}
    for length in lengths:
        result[length] = fn(model, random_prompt(length, vocab, seed=1), device)
        print(f"  sweep {engine} L={length}: {result[length] * 1000:.1f} ms/token", flush=True)
    return result


# ---- models --------------------------------------------------------------------------------------


def random_prompt(length: int, vocab: int, seed: int = 0) -> list[int]:
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def load_transformers(path: Path, device, dtype):
    from transformers import AutoModelForCausalLM

    placement = {} if device == "cpu" else {"device_map": device}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **placement).eval()
    # generate() fills unset fields from the checkpoint's sampling defaults (temperature 0.6, ...) and
    # then warns that greedy ignores them; clearing them here keeps the output readable.
    model.generation_config.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    return model


def free(device) -> None:
    """Give the memory of a model the caller has just dropped back before loading the next one."""
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def run_engines(model, engines: list[str], args, prompt, device, lengths, vocab) -> tuple[dict, dict]:
    """Time and sweep each engine of one loaded model."""
    results, sweeps = {}, {}
    for engine in engines:
        n = args.new_tokens if engine != "recompute" else args.recompute_new_tokens
        # Recompute keeps no state between runs, so a few tokens warm its kernels as well as n would.
        warmup = args.warmup_tokens or (n if engine != "recompute" else min(n, 4))
        print(f"{engine}: {n} new tokens, warm-up run of {warmup}, then {args.repeats} timed", flush=True)
        results[engine] = median_run(time_engine(engine, model, prompt, n, device, args.repeats, warmup))
        if lengths and engine in SWEEPS:
            sweeps[engine] = sweep(engine, model, lengths, vocab, device)
    return results, sweeps


def benchmark_size(size: str, args, device: str, dtype: torch.dtype, engines: list[str]) -> dict:
    """Transformers first, then ours: one model in memory at a time, so 8B fits on one GPU."""
    path = Path(args.checkpoint) if args.checkpoint else default_out(size)
    if not (path / "config.json").exists():
        print(f"writing a random Qwen3-{size}-shaped checkpoint to {path}", flush=True)
        make_shape_checkpoint(size, path)
    vocab = Qwen3Config.from_json(path / "config.json").vocab_size
    prompt = random_prompt(args.prompt_tokens, vocab)
    results, sweeps = {}, {}
    if "transformers" in engines:
        theirs = load_transformers(path, device, dtype)
        results, sweeps = run_engines(theirs, ["transformers"], args, prompt, device, args.sweep_lengths, vocab)
        del theirs
        free(device)
    mean_context = args.prompt_tokens + args.new_tokens // 2
    step_bytes = None
    for engine in [e for e in engines if e in OURS]:  # one model in memory at a time, in this engine's layout
        ours = load_model(path, device, dtype, **LAYOUTS[engine])
        if engine not in QUANTIZED or step_bytes is None:
            step_bytes = bytes_per_decode_step(ours, ours.config, mean_context, 1)
        r, s = run_engines(ours, [engine], args, prompt, device, args.sweep_lengths, vocab)
        results, sweeps = {**results, **r}, {**sweeps, **s}
        if engine in QUANTIZED:
            results[engine]["bytes_per_step"] = bytes_per_decode_step(ours, ours.config, mean_context, 1)
        del ours
        free(device)
    if "llamacpp" in engines:
        from llamacpp_engine import time_llamacpp

        dtype_name = args.llamacpp_quant or str(dtype).removeprefix("torch.")
        runs = time_llamacpp(path, dtype_name, prompt, args.new_tokens, torch.get_num_threads(), args.repeats)
        results["llamacpp"] = median_run([Run(len(r["tokens"]), r["ttft_s"], r["total_s"], r["tokens"]) for r in runs])
    if step_bytes is None:  # only transformers or llama.cpp: the same weights in the same dtype (Q8_0: our int8)
        model = load_model(path, device, dtype, quantize=args.llamacpp_quant)
        step_bytes = bytes_per_decode_step(model, model.config, mean_context, 1)
        del model
    return {"size": size, "checkpoint": str(path), "bytes_per_step": step_bytes, "mean_context": mean_context,
            "engines": results, "sweep": sweeps}


# ---- report --------------------------------------------------------------------------------------


def add_ratios(report: dict, bandwidth: float) -> None:
    """Ratio to transformers and share of the bandwidth limit, for every engine measured."""
    limit = bandwidth / report["bytes_per_step"]
    report["limit_tok_s"] = limit
    base = report["engines"].get("transformers")
    for result in report["engines"].values():
        result["vs_transformers"] = result["decode_tok_s"] / base["decode_tok_s"] if base else None
        # int8 and int4 read their own (smaller) bytes per step
        result["util"] = result["decode_tok_s"] * result.get("bytes_per_step", report["bytes_per_step"]) / bandwidth


def first_divergence(report: dict) -> dict:
    """Where each engine's greedy tokens first differ from transformers' (None: identical)."""
    engines = report["engines"]
    if "transformers" not in engines:
        return {}
    ref = engines["transformers"]["tokens"]
    return {name: next((i for i, (a, b) in enumerate(zip(ref, r["tokens"])) if a != b), None)
            for name, r in engines.items() if name != "transformers"}


def print_table(report: dict, engines: list[str], repeats: int) -> None:
    print(f"\nQwen3-{report['size']} shapes: {report['bytes_per_step'] / 1e9:.3f} GB read per decode step at "
          f"mean context {report['mean_context']}, bandwidth limit {report['limit_tok_s']:.1f} tok/s; "
          f"median of {repeats} runs\n")
    print("| engine | new tokens | TTFT (s) | decode tok/s | overall tok/s | vs transformers (decode) "
          "| util of limit |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for engine in ENGINES:
        r = report["engines"].get(engine)
        if r is None:
            why = "not asked for" if engine not in engines else "-"
            print(f"| {engine} | not measured ({why}) | | | | | |")
            continue
        ratio = f"{r['vs_transformers']:.2f}x" if r["vs_transformers"] else "not measured"
        print(f"| {engine} | {r['new_tokens']} | {r['ttft_s']:.3f} | {r['decode_tok_s']:.2f} | "
              f"{r['overall_tok_s']:.2f} | {ratio} | {r['util']:.0%} |")


def print_sweep(report: dict) -> None:
    sweeps = report["sweep"]
    if not sweeps:
        return
    names = [e for e in ENGINES if e in sweeps]
    lengths = list(next(iter(sweeps.values())))
    print("\nms per token at context length L (recompute: one forward over L tokens; cache: one decode step)\n")
    print("| L | " + " | ".join(names) + " |")
    print("|---:|" + "---:|" * len(names))
    for length in lengths:
        print(f"| {length} | " + " | ".join(f"{sweeps[n][length] * 1000:.1f}" for n in names) + " |")


def plot_sweep(report: dict, title: str, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    styles = {  # transformers and our cache nearly coincide, so they differ in line and marker too
        "transformers": dict(label="transformers (its own cache)", linestyle="--", marker="s", markersize=8),
        "recompute": dict(label="ours, full recompute", marker="o"),
        "cache": dict(label="ours, KV cache", marker="o"),
    }
    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    for name, times in report["sweep"].items():
        ax.plot([int(k) for k in times], [t * 1000 for t in times.values()], **styles[name])
    ax.set(xlabel="context length L (tokens)", ylabel="time per token (ms)", title=title)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def peak_rss_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


# ---- command line --------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Decode speed: transformers vs our recompute, cache and compiled loops.")
    p.add_argument("--sizes", default="0.6B", help="comma-separated Qwen3 shapes (default 0.6B)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda (auto: cuda if available)")
    p.add_argument("--dtype", default="auto", help="auto (fp32 on CPU, bf16 on GPU), float32, bfloat16, float16")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens generated per run (default 64)")
    p.add_argument("--recompute-new-tokens", type=int, default=None,
                   help="tokens for the recompute engine (default: --new-tokens; fewer keeps CPU runs short)")
    p.add_argument("--prompt-tokens", type=int, default=32, help="random prompt length, same for every engine")
    p.add_argument("--engines", default=None, help="comma-separated from " + ",".join(ENGINES) +
                   " (default: all; compiled only on CUDA)")
    p.add_argument("--sweep-lengths", default="64,128,256,512", help="context lengths for the sweep ('' skips it)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per engine; the median is reported")
    p.add_argument("--checkpoint", default=None,
                   help="use this folder instead of weights/qwen3-<size>-shapes (with one size only)")
    p.add_argument("--out", default="docs/benchmarks", help="folder for <device>_<size>.json and the PNG")
    p.add_argument("--warmup-tokens", type=int, default=None, help="tokens of the untimed warm-up run (default: as timed)")
    p.add_argument("--llamacpp-quant", choices=["int8", "int4"],
                   help="llamacpp engine: the Q8_0 (int8) or Q4_0 (int4) GGUF instead of --dtype's")  # fmt: skip
    p.add_argument("--table", action="store_true",
                   help="the issue's table: every engine and dtype in its own process, alternating (engine_table.py)")
    p.add_argument("--table-dtypes", default="float32,bfloat16,int8,int4", help="--table: the dtype columns")
    p.add_argument("--child-json", default=None, help=argparse.SUPPRESS)  # --table's worker processes
    args = p.parse_args(argv)
    args.sweep_lengths = [int(x) for x in args.sweep_lengths.split(",") if x.strip()]
    args.recompute_new_tokens = args.recompute_new_tokens or args.new_tokens
    return args


def resolve(args) -> tuple[str, torch.dtype, list[str]]:
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    on_gpu = device.startswith("cuda")
    name = args.dtype if args.dtype != "auto" else ("bfloat16" if on_gpu else "float32")
    default = ["transformers", "recompute", "cache"] + (["compiled"] if on_gpu else [])
    engines = args.engines.split(",") if args.engines else default
    unknown = set(engines) - set(ENGINES)
    if unknown or name not in DTYPES:
        raise SystemExit(f"unknown engine(s) {sorted(unknown)} or dtype {name!r}")
    return device, DTYPES[name], engines


def write_report(report: dict, args, info: dict, device: str, dtype: torch.dtype) -> None:
    """<device>_<size>.json (with _<dtype> when not the device's default) and its sweep plot."""
    out, kind = Path(args.out), torch.device(device).type
    out.mkdir(parents=True, exist_ok=True)
    dtype_name = str(dtype).removeprefix("torch.")
    default = torch.bfloat16 if kind == "cuda" else torch.float32
    stem = f"{kind}_{report['size']}" + ("" if dtype == default else f"_{dtype_name}")
    if report["sweep"]:
        title = f"Qwen3-{report['size']} shapes, {info.get('gpu', info['cpu'])}, {dtype_name}"
        plot_sweep(report, title, out / f"{stem}_time_per_token.png")
    record = {"machine": info, "device": device, "dtype": dtype_name, "args": vars(args), **report}
    (out / f"{stem}.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out / stem}.json" + (" and its _time_per_token.png" if report["sweep"] else ""))


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.table:
        from engine_table import run_table

        return run_table(args, argv if argv is not None else sys.argv[1:])
    device, dtype, engines = resolve(args)
    torch.set_grad_enabled(False)
    bandwidth = measure_bandwidth(device)
    info = machine(device, bandwidth)
    print(machine_line(info), flush=True)
    print("command: python scripts/bench/benchmark_decode.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    for size in args.sizes.split(","):
        report = benchmark_size(size, args, device, dtype, engines)
        add_ratios(report, bandwidth)
        if args.child_json:  # a worker of --table: the parent prints and writes the report
            report["peak_rss_mib"] = peak_rss_mib()
            Path(args.child_json).write_text(json.dumps(report))
            return
        print_table(report, engines, args.repeats)
        if args.recompute_new_tokens != args.new_tokens and "recompute" in engines:
            print(f"\nnote: recompute generated {args.recompute_new_tokens} tokens, the others {args.new_tokens}")
        print(f"greedy tokens first differ from transformers' at index: {first_divergence(report)} (None: identical)")
        print_sweep(report)
        write_report(report, args, info, device, dtype)


if __name__ == "__main__":
    main()
