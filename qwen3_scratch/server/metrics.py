"""The server's numbers, in Prometheus text (`GET /metrics`), written by the engine thread only.

Names follow vLLM's where one exists (`vllm:num_requests_running` -> `qwen3_num_requests_running`),
so dashboards built for it need only the prefix changed. The process's own numbers come too, as
Prometheus' standard `process_*` (resident memory, CPU seconds, open files), as vLLM's do.
"""

import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest

# Seconds; CPU decode steps run from milliseconds (tiny models) to seconds (large ones).
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServingMetrics:
    def __init__(self, window_seconds: float = 10.0):
        self.registry = CollectorRegistry()  # one per server, so tests can start several in a process
        r = self.registry
        ProcessCollector(registry=r)
        self.running = Gauge("qwen3_num_requests_running", "Requests in the running batch", registry=r)
        self.waiting = Gauge("qwen3_num_requests_waiting", "Requests waiting for KV memory", registry=r)
        self.blocks_used = Gauge("qwen3_kv_blocks_used", "KV cache blocks held by requests", registry=r)
        self.blocks_total = Gauge("qwen3_kv_blocks_total", "KV cache blocks in the pool", registry=r)
        self.hit_rate = Gauge("qwen3_prefix_cache_hit_rate", "Prompt tokens served from the prefix cache / looked up",
                              registry=r)  # fmt: skip
        self.tokens_per_second = Gauge("qwen3_generation_tokens_per_second",
                                       f"Output tokens per second over the last {window_seconds:g} s", registry=r)  # fmt: skip
        self.prompt_tokens = Counter("qwen3_prompt_tokens", "Prompt tokens received", registry=r)
        self.generation_tokens = Counter("qwen3_generation_tokens", "Output tokens generated", registry=r)
        self.aborted = Gauge("qwen3_num_requests_aborted", "Requests whose client went away", registry=r)
        self.failed = Counter("qwen3_num_requests_failed", "Requests failed by a fault inside the engine (HTTP 500)",
                              registry=r)  # fmt: skip
        self.preemptions = Counter("qwen3_num_preemptions", "Requests preempted for KV memory", registry=r)
        self.ttft = Histogram("qwen3_time_to_first_token_seconds", "Request arrival to its first output token",
                              buckets=LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.tpot = Histogram("qwen3_time_per_output_token_seconds", "Mean time between a request's output tokens",
                              buckets=LATENCY_BUCKETS, registry=r)  # fmt: skip
        # speculative decoding (engine/speculative.py), as vLLM's spec_decode counters, labelled by the
        # proposer (method="ngram" or "draft_model"), so servers running either add up on one dashboard
        self.spec = {
            "num_proposed": Counter("qwen3_spec_proposed_tokens", "Tokens proposed by speculation and checked",
                                    ["method"], registry=r),
            "num_accepted": Counter("qwen3_spec_accepted_tokens", "Proposed tokens the model kept", ["method"],
                                    registry=r),
            "num_emitted": Counter("qwen3_spec_emitted_tokens",
                                   "Tokens speculative rows emitted (kept proposals and the model's own)", ["method"],
                                   registry=r),
        }  # fmt: skip
        self._spec_seen = dict.fromkeys(self.spec, 0)
        self.window = window_seconds
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens) of recent steps

    def step(self, engine, new_tokens: int, preempted: int) -> None:
        """After each engine step: the counters and the token rate."""
        self.refresh(engine)
        self.generation_tokens.inc(new_tokens)
        self.preemptions.inc(preempted)
        speculator = getattr(engine, "speculator", None)
        if speculator is not None:  # the engine keeps totals; the counters advance by what this step added
            for name, counter in self.spec.items():
                total = getattr(speculator, name)
                counter.labels(method=speculator.method).inc(total - self._spec_seen[name])
                self._spec_seen[name] = total
        now = time.monotonic()
        self._recent.append((now, new_tokens))
        self.tokens_per_second.set(self.rate(now))

    def rate(self, now: float) -> float:
        """Output tokens per second over the steps of the last window before `now` (0 after a window idle)."""
        while self._recent and self._recent[0][0] < now - self.window:
            self._recent.popleft()
        span = now - self._recent[0][0] if len(self._recent) > 1 else self.window
        return sum(n for _, n in self._recent) / max(span, 1e-9)

    def refresh(self, engine) -> None:
        """The queue and memory gauges (plain reads of the engine's counters, safe from any thread)."""
        scheduler, blocks = engine.scheduler, engine.blocks
        self.running.set(len(scheduler.running))
        self.waiting.set(len(scheduler.waiting))
        self.blocks_used.set(blocks.num_used)
        self.blocks_total.set(blocks.num_blocks)
        self.hit_rate.set(blocks.prefix_hit_rate)
        self.aborted.set(engine.num_aborted)

    def finished(self, arrival: float, first_token: float | None, end: float, output_tokens: int) -> None:
        if first_token is None:
            return
        self.ttft.observe(first_token - arrival)
        if output_tokens > 1:
            self.tpot.observe((end - first_token) / (output_tokens - 1))

    def text(self, engine) -> bytes:
        self.refresh(engine)
        return generate_latest(self.registry)
