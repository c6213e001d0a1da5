"""The decode step's attention routes side by side, in one process, rounds alternating, against llama.cpp.

    python scripts/bench/attention_ab.py                       # bf16 and int4, 64 tokens, 3 rounds
    python scripts/bench/attention_ab.py --quantize none --rounds 5 --prompt-tokens 1000

For each model (bf16, and int4 weights with bf16 activations) it times --new-tokens greedy tokens with
each attention route of kernels/cpu_decode.py, switched per run on the same loaded model:
kernel: one_row_attention's stored kernel over the cache in place (the default without AMX; its package is
built first if none is stored); flash: SDPA's kernel on the bf16 cache (the default where the CPU has AMX);
fp32: the widened cache and SDPA's fp32 kernel (up to 256 slots; the model's own attention past that). And
llama.cpp's bf16 / Q4_0 file in the same process when llama-cpp-python is installed
(scripts/bench/llamacpp_engine.py --convert makes the files). Prints every run and the medians.
"""

import argparse
import statistics
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
for folder in (HERE.parents[1], HERE, HERE.parents[1] / "scripts" / "checkpoints"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

from benchmark_decode import random_prompt, time_ours  # noqa: E402
from machine import machine, machine_line  # noqa: E402
from make_shape_checkpoint import default_out  # noqa: E402

from qwen3_scratch.checkpoint.weights import load_model  # noqa: E402
from qwen3_scratch.kernels import aot, aot_build, cpu_decode, one_row_attention  # noqa: E402

LLAMA_FILE = {None: "bfloat16", "int4": "int4", "int8": "int8"}  # our model -> llama.cpp's file (gguf_path)


def llamacpp_timer(checkpoint: Path, quantize: str | None, prompt: list[int], n: int):
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    from llamacpp_engine import gguf_path

    path = gguf_path(checkpoint, LLAMA_FILE[quantize])
    if not path.exists():
        return None
    llm = Llama(str(path), n_ctx=len(prompt) + n + 8, n_threads=torch.get_num_threads(), verbose=False)

    def run() -> float:
        import time

        llm.reset()
        tokens, start, first = 0, time.perf_counter(), None
        for _ in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
            tokens += 1
            first = first or time.perf_counter()
            if tokens == n:
                break
        return (n - 1) / (time.perf_counter() - first)

    return run


ROUTES = {"kernel": (False, True), "flash": (True, False), "fp32": (False, False)}  # FLASH_ATTENTION, ONE_ROW_KERNEL


def store_one_row_kernel(model, prompt: list[int]) -> None:
    """one_row_attention's package for this model's heads and dtype, built now if none is stored (~20 s), and
    loaded: what every start after a first one runs."""
    if not aot.enabled():
        raise SystemExit("attention_ab.py: the kernel route needs stored kernels on (unset QWEN3_SCRATCH_AOT)")
    cpu_decode.FLASH_ATTENTION, cpu_decode.ONE_ROW_KERNEL = False, True
    time_ours(model, prompt, 2, "cpu", use_cache=True)  # compiles it, and names it for the builder
    for key in list(aot.PENDING.values()):
        if key["function"].endswith(":one_row_attention"):
            aot_build.build(key)
    one_row_attention.kernel.cache_clear()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", type=Path, default=default_out("0.6B"))
    p.add_argument("--quantize", default="none,int4", help="comma-separated: none (bf16), int8, int4")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--routes", default="kernel,flash,fp32", help="comma-separated: kernel, flash, fp32")
    p.add_argument("--threads", type=int, default=None, help="torch's and llama.cpp's threads (default: torch's)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(machine_line(machine("cpu")))
    for q in args.quantize.split(","):
        quantize = None if q == "none" else q
        model = load_model(args.checkpoint, "cpu", torch.bfloat16, optimize="decode", quantize=quantize)
        prompt = random_prompt(args.prompt_tokens, model.config.vocab_size)
        engines = {f"ours, {route} attention": ROUTES[route] for route in args.routes.split(",")}
        if "kernel" in args.routes:
            store_one_row_kernel(model, prompt)
        runs = {name: [] for name in [*engines, "llama.cpp"]}
        llama = llamacpp_timer(args.checkpoint, quantize, prompt, args.new_tokens)
        for i in range(args.rounds + 1):  # the first round warms up and is dropped
            for name, (flash, kernel) in list(engines.items())[:: 1 if i % 2 else -1]:  # the order alternates too
                cpu_decode.FLASH_ATTENTION, cpu_decode.ONE_ROW_KERNEL = flash, kernel
                runs[name].append(time_ours(model, prompt, args.new_tokens, "cpu", use_cache=True).decode_tok_s)
            if llama:
                runs["llama.cpp"].append(llama())
        for name, values in runs.items():
            if values[1:]:
                print(f"{q} {name}: median {statistics.median(values[1:]):.2f} tok/s, runs {[round(v, 2) for v in values[1:]]}")
        del model


if __name__ == "__main__":
    main()
