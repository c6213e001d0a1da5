"""The few sizes a serving step's shapes may take: every size is padded up to the next bucket.

A step's sizes change from step to step: how many rows decode, how many tokens the step packs, how long each
prompt chunk is and how many keys it attends. Caches keyed by shape grow with every new size and never
shrink: oneDNN keeps a primitive per matrix shape (~0.75 MiB each for the tiny model's bf16 linears, up to
1,024 of them), CPU SDPA's brgemm kernels one per tail size, a GPU a CUDA graph per batch size. A server
that ran a few hundred sizes held a few hundred MiB more than it needed (docs/performance.md, "Flat memory
under serving"). So every size is rounded up, as vLLM rounds its CUDA-graph batch sizes:

    1, 2, 4, 8, 16, 32, then every multiple of 32

which wastes at most 31 slots above 32 (under 50% at 33, under 7% at 512) and makes sizes up to n take
about n / 32 + 6 shapes. One policy for rows (decode batches, the GPU graphs), tokens (the packed step) and the
logits rows (engine/batch.py says how padding is kept from changing any real row). A prompt row's queries
and keys are not padded: masked pad keys change SDPA's last bits (packed_view.prompt_row).
"""

SMALL = (1, 2, 4, 8, 16, 32)
STRIDE = SMALL[-1]


def padded_size(n: int) -> int:
    """The smallest bucket >= n (n >= 1)."""
    if n <= STRIDE:
        return next(b for b in SMALL if b >= n)
    return -(-n // STRIDE) * STRIDE


def buckets_up_to(max_rows: int) -> list[int]:
    """The buckets below max_rows, and max_rows itself: a graph per bucket, none past what can run."""
    sizes = [b for b in SMALL if b < max_rows] + list(range(2 * STRIDE, max_rows, STRIDE)) + [max_rows]
    return sorted(set(sizes))


def bucket_for(rows: int, buckets: list[int]) -> int | None:
    """The smallest of `buckets` that holds `rows`; None above the largest."""
    return next((b for b in buckets if b >= rows), None)


def num_buckets(most: int) -> int:
    """How many distinct padded sizes the sizes 1..most take."""
    return len({padded_size(n) for n in range(1, most + 1)})
