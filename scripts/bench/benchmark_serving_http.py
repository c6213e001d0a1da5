"""Serving throughput over HTTP against any OpenAI-compatible server: ours (`qwen3-serve`) or vLLM's.

    python scripts/bench/benchmark_serving_http.py --url http://127.0.0.1:8000/v1 --model weights/qwen3-0.6b-shapes-serve \
        --concurrency 1,16 --label ours --out docs/benchmarks/serving_http.json

Each client sends POST /v1/completions with a prompt of --prompt-tokens random token ids (the same
ids for every server: a fixed seed), max_tokens --new-tokens, ignore_eos (vLLM's extension, which
qwen3-serve accepts too), stream on, usage in the last chunk, temperature --temperature (0: greedy).
At concurrency c, c clients start together, each sending --requests-per-client requests one after
another; output tok/s is all completion tokens over the wall time from the first request to the
last token. Per request: time to first token, and time per output token after it. Every request
must come back with exactly --new-tokens tokens (the server's own usage count), or the run fails.

Start one server at a time (they share the CPU) and wait for GET /health (ours) or /v1/models; one
warm-up request runs first, untimed, so that kernels a server builds lazily are built.
Results are appended to --out (a JSON list of runs), with --label and the time.
"""

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path

import httpx


def random_prompts(n: int, length: int, seed: int, vocab: int) -> list[list[int]]:
    """n prompts of `length` token ids below `vocab` (ordinary BPE tokens: no control token among them)."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]


async def one_request(client: httpx.AsyncClient, args, prompt: list[int]) -> dict:
    """Stream one completion; returns its start, first-token and end times and its token count."""
    body = {"model": args.model, "prompt": prompt, "max_tokens": args.new_tokens, "temperature": args.temperature,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    start, first, tokens = time.perf_counter(), None, None
    async with client.stream("POST", f"{args.url}/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{response.status_code}: {(await response.aread()).decode()[:300]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk.get("choices") and chunk["choices"][0].get("text"):
                first = time.perf_counter()
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    end = time.perf_counter()
    if tokens != args.new_tokens:
        raise RuntimeError(f"asked for {args.new_tokens} tokens with ignore_eos, the server reports {tokens}")
    return {"start": start, "first": first or end, "end": end, "tokens": tokens}


async def run_level(args, concurrency: int, prompts: list[list[int]]) -> dict:
    """`concurrency` clients at once, each sending its requests in turn -> tok/s, TTFT and TPOT."""
    per_client = [prompts[i :: concurrency] for i in range(concurrency)]
    limits = httpx.Limits(max_connections=concurrency + 1)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout), limits=limits) as client:

        async def client_loop(own: list[list[int]]) -> list[dict]:
            return [await one_request(client, args, p) for p in own]

        start = time.perf_counter()
        done = [r for rs in await asyncio.gather(*(client_loop(own) for own in per_client)) for r in rs]
        wall = time.perf_counter() - start
    ttft = [r["first"] - r["start"] for r in done]
    tpot = [(r["end"] - r["first"]) / max(r["tokens"] - 1, 1) for r in done]
    return {"concurrency": concurrency, "requests": len(done), "wall_s": round(wall, 2),
            "tokens_per_second": round(sum(r["tokens"] for r in done) / wall, 2),
            "ttft_s_p50": round(statistics.median(ttft), 3), "ttft_s_max": round(max(ttft), 3),
            "tpot_s_p50": round(statistics.median(tpot), 4)}  # fmt: skip


async def main_async(args) -> dict:
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout)) as client:  # warm-up, untimed
        await one_request(client, args, random_prompts(1, args.prompt_tokens, seed=999, vocab=args.vocab)[0])
    results = []
    for c in (int(x) for x in args.concurrency.split(",")):
        n = c * args.requests_per_client if c > 1 else args.single_requests
        prompts = random_prompts(n, args.prompt_tokens, seed=c, vocab=args.vocab)
        result = await run_level(args, c, prompts)
        print(json.dumps(result), flush=True)
        results.append(result)
    return {"label": args.label, "url": args.url, "model": args.model, "time": time.strftime("%Y-%m-%d %H:%M:%S"),
            "load_average_at_end": os.getloadavg(), "args": vars(args), "levels": results}  # fmt: skip


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Streamed-completion throughput of an OpenAI-compatible server.")
    p.add_argument("--url", default="http://127.0.0.1:8000/v1", help="the server's base URL, ending in /v1")
    p.add_argument("--model", required=True, help="the model name the server expects in requests")
    p.add_argument("--label", default="", help="a name for this run in --out (e.g. ours, vllm)")
    p.add_argument("--concurrency", default="1,16", help="client counts, comma-separated (default %(default)s)")
    p.add_argument("--requests-per-client", type=int, default=1, help="at concurrency > 1 (default %(default)s)")
    p.add_argument("--single-requests", type=int, default=2, help="requests sent one at a time at concurrency 1")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--vocab", type=int, default=151643, help="prompt ids are drawn below this (Qwen3's BPE ranks)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per request")
    p.add_argument("--out", default=None, help="JSON file the run is appended to")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    report = asyncio.run(main_async(args))
    if args.out:
        path = Path(args.out)
        runs = json.loads(path.read_text()) if path.exists() else []
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(runs + [report], indent=2) + "\n")


if __name__ == "__main__":
    main()
