"""Per-rank memory of every Qwen3 size under tensor parallelism: weights and KV cache, N = 1, 2, 4, 8.

    python scripts/bench/tp_sizes.py                 # bf16 weights and cache, KV at 32,768 tokens
    python scripts/bench/tp_sizes.py --tokens 131072

Counted from the published shapes (qwen3_scratch/model/sizes.py, `per_rank_bytes`), with the split of
qwen3_scratch/parallel/plan.py. Activations, the RoPE tables and the runtime's own memory come on top.
"""

import argparse

from qwen3_scratch.model.sizes import all_sizes, per_rank_bytes

GIB = 2**30


def table(tokens: int, ranks=(1, 2, 4, 8)) -> str:
    head = "| model | " + " | ".join(f"N={n}: weights / KV per rank" for n in ranks) + " |"
    lines = [head, "|---|" + "---:|" * len(ranks)]
    for name, config in all_sizes().items():
        cells = []
        for n in ranks:
            sizes = per_rank_bytes(config, n)
            cells.append("–" if sizes is None else f"{sizes[0] / GIB:.1f} / {sizes[1] * tokens / GIB:.2f} GiB")
        lines.append(f"| Qwen3-{name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32768, help="KV-cache tokens per rank (default %(default)s)")
    args = parser.parse_args(argv)
    print(f"bf16; KV cache for {args.tokens} tokens (all sequences together); '–': N cannot split that model")
    print(table(args.tokens))


if __name__ == "__main__":
    main()
