"""Soak the server: N clients for a fixed time, sending valid, invalid, aborted and long requests at once.

    python scripts/bench/soak.py --model weights/tiny-qwen3 --clients 16 --duration 300
    python scripts/bench/soak.py --url http://127.0.0.1:8000 --api-key KEY --model NAME   # a server already running

It starts `qwen3-serve` itself (unless --url), sends requests for --warmup seconds, then for --duration
seconds more, waits for the clients to stop, and reports (JSON on stdout, a summary on stderr):
requests served, answers by kind and status, p50/p99 latency by kind, the server's resident memory
(after warm-up, the peak sampled, at the end; read from its /metrics), the KV blocks held at the end.
It then sends SIGTERM to a server it started and checks that it exits 0. It exits 1 if any of these
fails: every valid request answered 200 (a 5xx, or a hang past --request-seconds, is a failure);
every invalid one a 4xx; no block held and nothing running once the clients stopped; the resident
memory at the end within --max-rss-growth-mb of the memory after warm-up (a bound for gross leaks: the
memory still rises a little while shape-keyed caches meet the last rare buckets, see docs/performance.md,
"Flat memory under serving"); exit 0 on SIGTERM.

The kinds of request, each client drawing one at a time (seeded by --seed; client i's first request after the
warm-up is the i-th kind, so that every kind is sent however few requests the window holds):
  chat, completion  valid, short (1-32 tokens), greedy or sampled, whole or streamed
  long              valid, 200-600 tokens past EOS, streamed
  aborted           a long stream the client drops after a few events (the server must free its blocks)
  invalid           one of HOSTILE: bad values, bad shapes, bad JSON, too big, too deep, not UTF-8, no key
"""

import argparse
import asyncio
import json
import random
import re
import statistics
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: server_process.py
from server_process import start_server, stop_server  # noqa: E402

KINDS = {"chat": 4, "completion": 3, "long": 1, "aborted": 1, "invalid": 3}  # relative weights
WORDS = "cache token model block prefix batch step queue answer reason server engine".split()


def hostile(model: str, max_body: int) -> dict:
    """name -> (body bytes, headers to drop): requests a server must refuse with a 4xx."""
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

    def body(**change):
        return json.dumps({**chat, **change}).encode()

    return {
        "seed 2**70": body(seed=2**70),
        "role wizard": body(messages=[{"role": "wizard", "content": "hi"}]),
        "negative temperature": body(temperature=-1),
        "max_tokens 0": body(max_tokens=0),
        "unknown model": body(model="gpt-9"),
        "content an object": body(messages=[{"role": "user", "content": {"a": 1}}]),
        "lone surrogate": body(messages=[{"role": "user", "content": "a\ud800"}]),
        "deep JSON": b"[" * 100_000 + b"]" * 100_000,
        "invalid UTF-8": b'{"model": "x", "messages": [{"role": "user", "content": "\xff\xfe"}]}',
        "malformed JSON": b'{"model": "x", "messages": [',
        "body over the limit": b'{"prompt": "' + b"a" * max_body + b'"}',
        "no API key": body(),
    }


def chat_body(model: str, rng: random.Random, max_tokens: int, stream: bool) -> dict:
    content = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40)))
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": rng.choice([0, 0.7]), "stream": stream}  # fmt: skip
    if rng.random() < 0.5:
        body["seed"] = rng.randrange(2**64)
    return body


class Soak:
    def __init__(self, args, url: str):
        self.args, self.url = args, url
        self.headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        self.hostile = hostile(args.model, args.max_body_bytes)
        self.answers: Counter = Counter()  # (kind, status or error name) -> count
        self.latency: dict[str, list[float]] = defaultdict(list)  # kind -> seconds, for answered requests
        self.failures: list[str] = []
        self.rss: list[tuple[float, float]] = []  # (time, bytes)
        self.measuring = False

    async def client(self, index: int, until: float) -> None:
        rng = random.Random(self.args.seed * 1000 + index)
        kinds, weights = zip(*KINDS.items())
        measured = False  # whether this client has sent a request since the measuring began
        async with httpx.AsyncClient(base_url=self.url, timeout=self.args.request_seconds) as client:
            while time.monotonic() < until or not measured:
                if self.measuring and not measured:
                    # Each client's first measured request is a kind of its own (client i: the i-th kind), sent even
                    # if the window has closed: a window too short for many requests (a slow CPU, a server still
                    # compiling its kernels) still sends every kind, given as many clients as kinds.
                    kind, measured = kinds[index % len(kinds)], True
                else:
                    kind = rng.choices(kinds, weights)[0]
                started = time.monotonic()
                try:
                    status = await getattr(self, kind)(client, rng)
                except httpx.HTTPError as error:  # a hang past --request-seconds, a connection reset
                    status = type(error).__name__
                self.record(kind, status, time.monotonic() - started)

    def record(self, kind: str, status, seconds: float) -> None:
        if not self.measuring:
            return
        self.answers[(kind, str(status))] += 1
        if kind != "invalid" and status != 200:
            self.failures.append(f"a valid {kind} request got {status}")
        elif kind == "invalid" and not (isinstance(status, int) and 400 <= status < 500):
            self.failures.append(f"an invalid request got {status}")
        elif kind != "aborted":
            self.latency[kind].append(seconds)

    async def chat(self, client, rng):
        body = chat_body(self.args.model, rng, rng.randint(1, 32), stream=rng.random() < 0.5)
        return await self.send(client, "/v1/chat/completions", body)

    async def completion(self, client, rng):
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 60)))
        body = {"model": self.args.model, "prompt": prompt, "max_tokens": rng.randint(1, 32),
                "temperature": rng.choice([0, 0.9]), "stream": rng.random() < 0.5}  # fmt: skip
        return await self.send(client, "/v1/completions", body)

    async def long(self, client, rng):
        body = {**chat_body(self.args.model, rng, rng.randint(200, 600), stream=True), "ignore_eos": True}
        return await self.send(client, "/v1/chat/completions", body)

    async def aborted(self, client, rng):
        body = {**chat_body(self.args.model, rng, 600, stream=True), "ignore_eos": True}
        keep = rng.randint(1, 5)
        async with client.stream("POST", "/v1/chat/completions", json=body, headers=self.headers) as response:
            events = 0
            async for line in response.aiter_lines():
                events += line.startswith("data: ")
                if events >= keep:
                    break  # leaving the block closes the connection mid-stream
            return response.status_code

    async def invalid(self, client, rng):
        name = rng.choice(sorted(self.hostile))
        headers = {"Content-Type": "application/json", **({} if name == "no API key" else self.headers)}
        path = "/v1/completions" if name == "body over the limit" else "/v1/chat/completions"
        try:
            return (await client.post(path, content=self.hostile[name], headers=headers)).status_code
        except httpx.HTTPError as error:
            return f"{type(error).__name__} on {name}"

    async def send(self, client, path, body):
        """A whole answer, or a stream read to its end (which must be `data: [DONE]`)."""
        if not body["stream"]:
            return (await client.post(path, json=body, headers=self.headers)).status_code
        async with client.stream("POST", path, json=body, headers=self.headers) as response:
            last = [line async for line in response.aiter_lines() if line][-2:]
            if response.status_code == 200 and last[-1:] != ["data: [DONE]"]:
                return "stream without [DONE]"
            if response.status_code == 200 and '"error"' in last[0]:
                return "error event"
            return response.status_code

    async def watch_memory(self, until: float) -> None:
        async with httpx.AsyncClient(base_url=self.url, timeout=10) as client:
            while time.monotonic() < until:
                rss = metric(await server_metrics(client), "process_resident_memory_bytes")
                if rss is not None:
                    self.rss.append((time.monotonic(), rss))
                await asyncio.sleep(0.25)

    async def run(self) -> dict:
        start = time.monotonic()
        measured_from = start + self.args.warmup
        until = measured_from + self.args.duration
        clients = [asyncio.create_task(self.client(i, until)) for i in range(self.args.clients)]
        watcher = asyncio.create_task(self.watch_memory(until + self.args.request_seconds))
        await asyncio.sleep(self.args.warmup)
        self.measuring = True
        await asyncio.gather(*clients)
        watcher.cancel()
        async with httpx.AsyncClient(base_url=self.url, timeout=10) as client:
            await asyncio.sleep(0.5)  # aborts reach the engine thread between steps
            final = await server_metrics(client)
        return self.report(start, measured_from, final)

    def report(self, start: float, measured_from: float, final: str) -> dict:
        warm = [rss for t, rss in self.rss if t <= measured_from][-1:] or [None]
        end_rss = metric(final, "process_resident_memory_bytes")
        held = {name: metric(final, name) for name in ("qwen3_kv_blocks_used", "qwen3_num_requests_running",
                                                       "qwen3_num_requests_waiting")}  # fmt: skip
        if any(value for value in held.values()):
            self.failures.append(f"after the clients stopped the server still holds {held}")
        growth = (end_rss - warm[0]) / 2**20 if end_rss and warm[0] else None
        if growth is not None and growth > self.args.max_rss_growth_mb:
            self.failures.append(f"resident memory grew {growth:.0f} MiB after warm-up")
        served = sum(n for (kind, status), n in self.answers.items() if status == "200" and kind != "invalid")
        return {
            "clients": self.args.clients, "warmup_s": self.args.warmup, "duration_s": self.args.duration,
            "requests": sum(self.answers.values()), "served_200": served,
            "answers": {f"{kind} {status}": n for (kind, status), n in sorted(self.answers.items())},
            "latency_s": {kind: {"p50": round(percentile(v, 50), 3), "p99": round(percentile(v, 99), 3), "n": len(v)}
                          for kind, v in sorted(self.latency.items())},  # fmt: skip
            "rss_mib": {"after_warmup": mib(warm[0]), "peak_sampled": mib(max((r for _, r in self.rss), default=None)),
                        "end": mib(end_rss), "growth": None if growth is None else round(growth, 1)},  # fmt: skip
            "rss_mib_every_tenth": [mib(r) for r in tenths([r for t, r in self.rss if t > measured_from])],
            "held_at_end": held,
            "failures": sorted(Counter(self.failures).items()),
        }


def percentile(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else (values or [0])[0]


def tenths(values: list) -> list:
    return [values[len(values) * i // 10] for i in range(10)] + values[-1:] if values else []


def mib(value):
    return None if value is None else round(value / 2**20, 1)


async def server_metrics(client) -> str:
    return (await client.get("/metrics")).text


def metric(text: str, name: str) -> float | None:
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else None


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="weights/tiny-qwen3", help="checkpoint to serve, or the served name with --url")
    p.add_argument("--url", help="soak a server already running here (no SIGTERM check)")
    p.add_argument("--api-key", default="soak-key")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--duration", type=float, default=60.0, help="seconds measured, after the warm-up")
    p.add_argument("--warmup", type=float, default=10.0, help="seconds of load before measuring")
    p.add_argument("--request-seconds", type=float, default=120.0, help="a request not answered by then hung")
    p.add_argument("--max-body-bytes", type=int, default=2**20, help="the server's --max-body-bytes")
    p.add_argument("--max-rss-growth-mb", type=float, default=256.0,
                   help="resident memory may grow this much after the warm-up (rare buckets still fill caches)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-args", default="--num-blocks 256 --shutdown-grace 10",
                   help="more flags for the server it starts")  # fmt: skip
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    process = None
    url = args.url
    if url is None:
        extra = args.server_args.split() + ["--max-body-bytes", str(args.max_body_bytes)]
        process, url = start_server(args.model, extra, args.api_key)
    try:
        report = asyncio.run(Soak(args, url).run())
    finally:
        if process is not None:
            status, seconds = stop_server(process, grace=10)
    if process is not None:
        report["sigterm"] = {"exit_status": status, "seconds": round(seconds, 2)}
        if status != 0:
            report["failures"].append((f"the server exited {status} on SIGTERM", 1))
    print(json.dumps(report, indent=1))
    lat = ", ".join(f"{k} p50 {v['p50']:.3f} s p99 {v['p99']:.3f} s" for k, v in report["latency_s"].items())
    print(f"{report['requests']} requests, {report['served_200']} valid ones served; {lat}; RSS {report['rss_mib']}; "
          f"failures: {report['failures'] or 'none'}", file=sys.stderr)  # fmt: skip
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
