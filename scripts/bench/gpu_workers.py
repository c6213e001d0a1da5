"""The measurements behind scripts/gpu_check.py, one step per process (gpu_check runs each with its own time
limit). Each worker writes its JSON record after every measurement, so a step cut short keeps what it had.

    decode        ours, batch 1, greedy, bf16 (or int8/int4) weights: "graphs" (the default command: CUDA
                  graphs, no compile), "compiled" (--compile: inductor, CUDA graphs) or "eager" (op by op)
    transformers  `generate` eagerly (DynamicCache), and with a StaticCache of one fixed length (transformers
                  then compiles its forward, "reduce-overhead", on a GPU; the same length every call, or it
                  would compile again)
    workload      the engine on nano-vLLM's benchmark workload by one attention route, and the fraction of a
                  window of its steps the GPU was running kernels (scripts/bench/nano_vllm_workload.py's run())
    profile       one decode step's kernels under torch.profiler: how many, their GPU time against the step's
                  wall time, the costliest (what to fuse next)

Variants of `decode` are "<weights>/<mode>": weights bfloat16, int8 (the device's default int8 route:
one compiled kernel a one-row product on a GPU, kernels/quantize.py's "row-kernel"), int8cast (gpt-fast's
F.linear over the cast weight, "fused-cast"), int8pack (torch._weight_int8pack_mm) or int4 (tinygemm on a GPU); modes
eager, graphs (the default: CUDA graphs over the layers' compiled glue, kernels/gpu_decode.py), graphs-plain
(graphs over the plain layers, op by op), compiled.
"""

import json
import sys
import time
import traceback
from contextlib import contextmanager
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
for folder in (HERE.parent.parent, HERE.parent, HERE.parent / "checkpoints", HERE):  # run from the source tree
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

from qwen3_scratch.generation.stats import bytes_per_decode_step, measure_bandwidth, synchronize  # noqa: E402

PROMPT_LEN = 16
SCHEMES = {"bfloat16": (None, None), "int8": ("int8", None), "int8cast": ("int8", "fused-cast"),
           "int8pack": ("int8", "int8pack"), "int4": ("int4", None)}  # (quantize, int8 route; None: as loaded)
DEFAULT_INT8 = {"cuda": "row-kernel", "cpu": "cpu"}  # the int8 route the "decode" layout picks on each device
# generate_tokens' arguments for each mode ("graphs-plain" also swaps the layers: layers_for)
MODES = {"eager": {"cuda_graphs": False}, "graphs": {"cuda_graphs": True}, "graphs-plain": {"cuda_graphs": True},
         "compiled": {"compile": True}}  # fmt: skip


def progress(message: str) -> None:
    print(f"    {message}", flush=True)


def record_result(record: dict, out: Path, key: str, measure) -> None:
    """record["results"][key] = measure(), or the error it raised; written to `out` either way."""
    start = time.perf_counter()
    try:
        result = measure()
    except Exception as e:  # noqa: BLE001 - recorded, and the next measurement runs
        result = {"error": f"{type(e).__name__}: {e}"[:500], "trace": traceback.format_exc()[-800:]}
    record["results"][key] = result
    shown = {k: round(v, 3) if isinstance(v, float) else v for k, v in result.items() if k not in ("tokens", "trace", "top")}
    progress(f"{key}: {shown} ({time.perf_counter() - start:.1f} s)")
    out.write_text(json.dumps(record))


def prompt_ids(vocab_size: int) -> list[int]:
    return torch.randint(0, vocab_size, (PROMPT_LEN,), generator=torch.Generator().manual_seed(0)).tolist()


# ---- ours --------------------------------------------------------------------------------------------------


@contextmanager
def layers_for(model, mode: str):
    """Mode "graphs-plain": the plain layers in place of the compiled glue (kernels/gpu_decode.py) for the
    measurement, as loaded afterwards; graphs captured over either are dropped on the way in and out."""
    if mode != "graphs-plain":
        yield
        return
    from qwen3_scratch.generation.cuda_graph import forget_graphs
    from qwen3_scratch.kernels.gpu_decode import GPUDecoderLayer
    from qwen3_scratch.model.qwen3 import DecoderLayer

    glued = [layer for layer in model.model.layers if type(layer) is GPUDecoderLayer]
    for layer in glued:
        layer.__class__ = DecoderLayer
    forget_graphs(model)
    try:
        yield
    finally:
        for layer in glued:
            layer.__class__ = GPUDecoderLayer
        forget_graphs(model)


def norm_mismatch(dim: int, device, dtype, rows: int = 4096) -> float:
    """The share of output elements in which the glue's compiled RMSNorm (gpu_decode.norm) differs from the
    eager one, over random rows of width dim (activations of a few scales, a weight near 1, as a model's are)."""
    from qwen3_scratch.kernels.gpu_decode import norm
    from qwen3_scratch.kernels.matvec import kernel
    from qwen3_scratch.model.qwen3 import rms_norm

    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(rows, dim, generator=g, device=device) * torch.rand(rows, 1, generator=g, device=device) * 8
    weight = (1 + 0.1 * torch.randn(dim, generator=g, device=device)).to(dtype)
    x = x.to(dtype)
    return (kernel(norm, x, weight, eps=1e-6)(x, weight) != rms_norm(x, weight, 1e-6)).float().mean().item()


def time_ours(model, device: str, mode: str, new_tokens: int) -> dict:
    """Decode tok/s after a warm-up generation (which pays the capture or the compile: warmup_s)."""
    from qwen3_scratch.generation.loops import generate_tokens
    from qwen3_scratch.sampling.logits import LogitsFilter

    how = MODES[mode]
    ids = prompt_ids(model.config.vocab_size)

    def run(n):
        start = time.perf_counter()
        steps = generate_tokens(model, [ids], n, LogitsFilter(temperature=0.0), ignore_eos=True, **how)
        first = next(steps)
        synchronize(device)
        ttft = time.perf_counter() - start
        rest = list(steps)
        synchronize(device)
        return ttft, time.perf_counter() - start, torch.cat([first, *rest]).tolist()

    start = time.perf_counter()
    run(min(new_tokens, 8))
    warmup_s = time.perf_counter() - start
    ttft, total, tokens = run(new_tokens)
    return {"decode_tok_s": (new_tokens - 1) / (total - ttft), "ttft_s": ttft, "warmup_s": warmup_s, "tokens": tokens}


def decode_worker(args, out: Path) -> None:
    """Each variant of args.variants on one size: loaded once per weight scheme, in the order given."""
    from gpu_checkpoints import load_or_draw

    from qwen3_scratch.generation.cuda_graph import forget_graphs
    from qwen3_scratch.kernels.quantize import use_int8_route

    record = {"size": args.size, "results": {}}
    record["bandwidth_gb_s"] = measure_bandwidth(args.device) / 1e9
    if "bfloat16/graphs" in args.variants.split(","):  # how often the glue's norm differs from the eager one
        record_result(record, out, "norm mismatch", lambda: {f"{str(dtype)[6:]} width {dim}": norm_mismatch(
                      dim, args.device, dtype) for dtype in (torch.bfloat16, torch.float32) for dim in (128, 1024, 4096)})  # fmt: skip
    model, loaded = None, "nothing yet"
    for variant in args.variants.split(","):
        weights, mode = variant.split("/")
        quantize, route = SCHEMES[weights]
        if mode == "compiled" and args.device != "cuda":
            record["results"][variant] = {"skipped": "--compile is for CUDA"}
            out.write_text(json.dumps(record))
            continue
        if loaded != quantize:
            model = None  # one model in memory at a time: 8B twice would not fit beside the cache
            torch.cuda.empty_cache() if args.device == "cuda" else None
            start = time.perf_counter()
            model, record["checkpoint_s"] = load_or_draw(args.size, args.device, args.weights, quantize)
            loaded = quantize
            progress(f"loaded {args.size} ({quantize or 'bf16'}) in {time.perf_counter() - start:.1f} s")
        use_int8_route(model, route or DEFAULT_INT8[torch.device(args.device).type])
        forget_graphs(model)  # a graph captured over the other route's kernels would replay them
        step_bytes = bytes_per_decode_step(model, model.config, PROMPT_LEN + args.new_tokens // 2, 1)

        def measure(mode=mode, model=model, step_bytes=step_bytes):
            with layers_for(model, mode):
                r = time_ours(model, args.device, mode, args.new_tokens)
            r["util"] = r["decode_tok_s"] * step_bytes / (record["bandwidth_gb_s"] * 1e9)
            return {**r, "bytes_per_step": step_bytes}

        record_result(record, out, variant, measure)


def kernel_table(model, device: str, mode: str, new_tokens: int) -> tuple[dict, float]:
    """({kernel name: [launches, microseconds]}, wall seconds) over a greedy run of new_tokens from the prompt,
    under torch.profiler (the GPU's kernels; on a CPU, the aten ops: the smoke run)."""
    from torch.profiler import ProfilerActivity, profile

    from qwen3_scratch.generation.loops import generate_tokens
    from qwen3_scratch.sampling.logits import LogitsFilter

    how = MODES[mode]
    ids, cuda = prompt_ids(model.config.vocab_size), device == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        list(generate_tokens(model, [ids], new_tokens, LogitsFilter(temperature=0.0), ignore_eos=True, **how))
        synchronize(device)
        wall = time.perf_counter() - start
    table = {}
    for e in prof.events():
        if (e.device_type.name == "CUDA") == cuda:
            entry = table.setdefault(e.name[:90], [0, 0.0])
            entry[0] += 1
            entry[1] += e.time_range.end - e.time_range.start
    return table, wall


def fastest(tables: list[tuple[dict, float]]) -> tuple[dict, float]:
    """kernel_table's least time for each kernel, and the least wall time, over a few runs: a host busy with
    something else only ever adds time, and one slow short run made a step's time negative on a shared CPU."""
    fastest = {name: [launches, min(t[0][name][1] for t in tables if name in t[0])]
               for name, (launches, _) in tables[0][0].items()}  # fmt: skip
    return fastest, min(wall for _, wall in tables)


def profile_step(model, device: str, mode: str, top: int = 14) -> dict:
    """One decode step's kernels: how many launch, their summed GPU time against the step's wall time (the
    rest is the GPU waiting on the host, or gaps between kernels), and the costliest kernels. A step is the
    difference of a 10-token and a 2-token run, over 8 (the prefill and the first token cancel out)."""
    kernel_table(model, device, mode, 2)  # the capture, cuBLAS's handles, lazy state
    # the short and the long runs alternate: a host that slows down or speeds up over the runs moves both alike (the
    # three short runs first, then the three long ones, once gave a negative step on a loaded 2-core CPU)
    runs = [(kernel_table(model, device, mode, 2), kernel_table(model, device, mode, 10)) for _ in range(3)]
    (short, wall_short), (long, wall_long) = fastest([s for s, _ in runs]), fastest([t for _, t in runs])
    step = {name: [(long[name][0] - short.get(name, [0, 0])[0]) / 8, (long[name][1] - short.get(name, [0, 0])[1]) / 8]
            for name in long}  # fmt: skip
    busy_us = sum(t for _, t in step.values())
    wall_us = (wall_long - wall_short) / 8 * 1e6
    costliest = sorted(step.items(), key=lambda kv: -kv[1][1])[:top]
    return {"kernels_per_step": round(sum(n for n, _ in step.values()), 1), "kernel_us_per_step": round(busy_us, 1),
            "wall_us_per_step": round(wall_us, 1), "busy": round(busy_us / wall_us, 3) if wall_us > 0 else None,
            "top": [{"kernel": k, "per_step": round(n, 2), "us_per_step": round(t, 1)} for k, (n, t) in costliest]}  # fmt: skip


def profile_worker(args, out: Path) -> None:
    """Where a decode step's time goes (profile_step), for each "<weights>/<mode>" of --variants: the figures
    that say what to fuse next (a graph replays the eager step's kernels, so their count and times are its)."""
    from gpu_checkpoints import load_or_draw

    from qwen3_scratch.generation.cuda_graph import forget_graphs
    from qwen3_scratch.kernels.quantize import use_int8_route

    record, model, loaded = {"size": args.size, "results": {}}, None, "nothing yet"
    for variant in args.variants.split(","):
        weights, mode = variant.split("/")
        quantize, route = SCHEMES[weights]
        if loaded != quantize:
            model = None
            torch.cuda.empty_cache() if args.device == "cuda" else None
            model, _ = load_or_draw(args.size, args.device, args.weights, quantize)
            loaded = quantize
        if mode == "compiled" and args.device != "cuda":
            record["results"][f"profile {variant}"] = {"skipped": "--compile is for CUDA"}
            out.write_text(json.dumps(record))
            continue
        use_int8_route(model, route or DEFAULT_INT8[torch.device(args.device).type])
        forget_graphs(model)
        def measure(mode=mode, model=model):
            with layers_for(model, mode):
                return profile_step(model, args.device, mode)

        record_result(record, out, f"profile {variant}", measure)


# ---- transformers ------------------------------------------------------------------------------------------


def time_transformers(model, device: str, new_tokens: int, static: bool) -> dict:
    """`generate`'s decode tok/s: (n - 1) tokens over the time n tokens take beyond the first."""
    import warnings

    ids = torch.tensor([prompt_ids(model.config.vocab_size)], device=device)
    cache = None
    if static:  # one length for every call (prompt + the longest run), so its compiled forward is reused
        from transformers import StaticCache

        cache = StaticCache(config=model.config, max_cache_len=PROMPT_LEN + new_tokens)

    def run(n):
        kwargs = {} if cache is None else {"past_key_values": cache}
        if cache is not None:
            cache.reset()
        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # past_key_values's rename to `cache` in transformers 5
            out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0, **kwargs)
        synchronize(device)
        return time.perf_counter() - start, out[0, PROMPT_LEN:].tolist()

    start = time.perf_counter()
    run(min(new_tokens, 8))  # the compile, with a static cache on a GPU
    warmup_s = time.perf_counter() - start
    first, _ = run(1)
    total, tokens = run(new_tokens)
    result = {"decode_tok_s": (new_tokens - 1) / (total - first), "ttft_s": first, "warmup_s": warmup_s,
              "tokens": tokens}  # fmt: skip
    if static:
        result["compiled"] = torch.device(device).type == "cuda"
    return result


def transformers_worker(args, out: Path) -> None:
    from gpu_checkpoints import checkpoint_folder
    from transformers import AutoModelForCausalLM

    record = {"size": args.size, "results": {}}
    folder = checkpoint_folder(args.size, args.device, args.weights)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to(args.device).eval()
    for variant in args.variants.split(","):
        new_tokens = args.new_tokens if variant == "static-compile" else min(args.new_tokens, 32)  # eager is slow
        record_result(record, out, f"transformers/{variant}",
                      lambda v=variant, n=new_tokens: time_transformers(model, args.device, n, v == "static-compile"))


# ---- the engine --------------------------------------------------------------------------------------------


def workload_worker(args, out: Path) -> None:
    """nano-vLLM's benchmark workload through the engine by each of --variants: an attention route, "-sync" after
    it for steps that read their tokens back at once (no async scheduling); with the GPU's busy fraction over a
    window of its steps (nano_vllm_workload.py's run())."""
    import nano_vllm_workload as workload
    from gpu_checkpoints import load_or_draw

    record = {"size": args.size, "results": {}}
    kwargs = {"device": args.device, "seed": 0, "host_steps": 16}
    if args.size == "tiny":  # the smoke run: a few short requests
        kwargs |= {"num_requests": 4, "max_len": 24}
    else:  # nano-vLLM's 256 requests did not finish inside the step's 76 s on an H100 (first run): a quarter of them
        kwargs |= {"num_requests": 64}
    record["run_kwargs"] = {k: str(v) for k, v in kwargs.items()}
    model, _ = load_or_draw(args.size, args.device, args.weights, None, optimize="batch")
    for variant in (args.variants or "flex").split(","):
        route, _, sync = variant.partition("-")
        progress(f"drew {args.size}; the workload by the {route} route{', steps read at once' if sync else ''}")
        record_result(record, out, f"engine/workload {variant}",
                      lambda r=route, a=not sync: workload.run(model, route=r, async_scheduling=a, **kwargs))


WORKERS = {"decode": decode_worker, "transformers": transformers_worker, "workload": workload_worker,
           "profile": profile_worker}


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(description="one of scripts/gpu_check.py's steps (it runs these)")
    p.add_argument("kind", choices=sorted(WORKERS))
    p.add_argument("--size", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--variants", default="")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--weights", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True, help="the JSON record")
    args = p.parse_args(argv)
    WORKERS[args.kind](args, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
