"""The decode step's attention routes side by side, in one process, rounds alternating, against llama.cpp.

    python scripts/bench/attention_ab.py                       # bf16 and int4, 64 tokens, 3 rounds
    python scripts/bench/attention_ab.py --quantize none --rounds 5

For each model (bf16, and int4 weights with bf16 activations) it times --new-tokens greedy tokens with
each attention route of kernels/cpu_decode.py (flash: SDPA's kernel, the default where the CPU has AMX;
fp32: the widened cache and two fp32 products), switched per run on the same loaded model, and
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
from qwen3_scratch.kernels import cpu_decode  # noqa: E402

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


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", type=Path, default=default_out("0.6B"))
    p.add_argument("--quantize", default="none,int4", help="comma-separated: none (bf16), int8, int4")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch's and llama.cpp's threads (default: torch's)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(machine_line(machine("cpu")))
    for q in args.quantize.split(","):
        quantize = None if q == "none" else q
        model = load_model(args.checkpoint, "cpu", torch.bfloat16, optimize="decode", quantize=quantize)
        prompt = random_prompt(args.prompt_tokens, model.config.vocab_size)
        engines = {"ours, flash attention": True, "ours, fp32 attention": False}
        runs = {name: [] for name in [*engines, "llama.cpp"]}
        llama = llamacpp_timer(args.checkpoint, quantize, prompt, args.new_tokens)
        for i in range(args.rounds + 1):  # the first round warms up and is dropped
            for name, flash in list(engines.items())[:: 1 if i % 2 else -1]:  # the order alternates too
                cpu_decode.FLASH_ATTENTION = flash
                runs[name].append(time_ours(model, prompt, args.new_tokens, "cpu", use_cache=True).decode_tok_s)
            if llama:
                runs["llama.cpp"].append(llama())
        for name, values in runs.items():
            if values[1:]:
                print(f"{q} {name}: median {statistics.median(values[1:]):.2f} tok/s, runs {[round(v, 2) for v in values[1:]]}")
        del model


if __name__ == "__main__":
    main()
