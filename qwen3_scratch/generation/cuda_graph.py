"""Batch-1 (and small-batch) decode replayed from a CUDA graph: the default on a GPU, with no compile.

A decode step is memory-bound, but it is also ~40 small kernels a layer (28-36 layers): launched one by one
from Python, the launches cost more than the kernels run (the eager loop reached 31 tok/s on the 0.6B shapes
on an H100 whose bandwidth allows ~2,500). A CUDA graph records the whole step once and replays it with one
launch. This is what vLLM and nano-vLLM do ("a capture per batch size"), and it costs the time of a few eager
steps, not the 40-60 s of an inductor compile (`--compile` is still there for inductor's fused kernels).

A graph replays fixed kernels on fixed addresses, so everything a step reads lives in static buffers:

  - the inputs: the token ids (B, 1), their RoPE positions (B, 1) and the cache slot (1,) they are written
    at, into which each step copies its real values before the replay;
  - the KV cache: a static cache (loops.static_cache) attended over all of its S slots, unwritten ones
    masked, so no shape depends on the step;
  - the model's weights and RoPE tables: a runner is captured against one table and captured again if
    `reserve_positions` built a longer one.

The output logits (B, V) are the graph's own buffer too: valid until the next replay (the loop samples from
them first). One runner per model and batch size, kept with that batch size's static cache.

The capture is a strategy passed in: `capture_cuda_graph` on a GPU; `run_eagerly` (the same static-buffer
function called at each step) anywhere else, which is how the CPU tests prove that the buffers, the copy-in
and the replay give the eager loop's tokens (tests/test_generate.py).

Shapes: B batch, V vocab.
"""

import weakref
from collections.abc import Callable

import torch

from qwen3_scratch.model.kv_cache import KVCache
from qwen3_scratch.model.qwen3 import Qwen3

Step = Callable[[], torch.Tensor]  # a decode step over the static buffers -> logits (B, V)
Capture = Callable[[Step], Step]  # records a step once; returns what replays it


def run_eagerly(step: Step) -> Step:
    """No graph: every replay runs the step's kernels again (CPU, and the tests)."""
    return step


def capture_cuda_graph(step: Step) -> Step:
    """Record `step` as one CUDA graph; the returned replay launches it and hands back its output buffer."""
    side = torch.cuda.Stream()  # warm up off the default stream, as torch.cuda.graphs recommends
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # cuBLAS handles, workspaces and lazy allocations happen here, not inside the graph
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logits = step()  # recorded, not run: the first replay computes it

    def replay() -> torch.Tensor:
        graph.replay()
        return logits

    return replay


class GraphedDecode:
    """`loops.decode_step` for one model, batch size and static cache, replayed from static buffers."""

    def __init__(self, model: Qwen3, cache: KVCache, capture: Capture):
        B, device = cache.keys.shape[1], cache.keys.device
        self.model, self.cache, self.capture = model, cache, capture
        self.tokens = torch.zeros(B, 1, dtype=torch.long, device=device)  # (B, 1)
        self.positions = torch.zeros(B, 1, dtype=torch.long, device=device)  # (B, 1)
        self.slot = torch.zeros(1, dtype=torch.long, device=device)  # (1,)
        self.replay: Step | None = None
        self.rope = None  # the RoPE table the graph reads

    def step(self) -> torch.Tensor:
        # mask None: the model masks by slot over the whole cache (attention_mask), inside the graph
        return self.model(self.tokens, self.positions, None, self.cache, self.slot, last_only=True)[:, -1]

    def prepare(self, first_slot: torch.Tensor) -> None:
        """Capture now, before the first step (a capture waits for the GPU; the steps must not).

        The warm-up and the capture write keys and values at `first_slot` from stale inputs; the first real
        step writes that slot again before any query reads it, and later slots are masked until written.
        """
        if self.replay is None or self.rope is not self.model.rope_cos:
            self.slot.copy_(first_slot)
            self.rope = self.model.rope_cos
            self.replay = self.capture(self.step)

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        """tokens, positions (B, 1), slot (1,) -> the next-token logits (B, V), valid until the next call."""
        self.tokens.copy_(tokens)
        self.positions.copy_(positions)
        self.slot.copy_(slot)
        return self.replay()


# One runner per model and batch size, rebuilt when that batch size's static cache was outgrown (a new
# cache is new addresses): a later generation of the same batch size replays the graph already captured.
_RUNNERS: "weakref.WeakKeyDictionary[Qwen3, dict[int, GraphedDecode]]" = weakref.WeakKeyDictionary()


def graphed_decode(model: Qwen3, cache: KVCache, capture: Capture | None = None) -> GraphedDecode:
    """The runner for `model` over `cache` (a static cache), made on first use; the capture defaults to a
    CUDA graph on a GPU and to running eagerly elsewhere."""
    runners = _RUNNERS.setdefault(model, {})
    B = cache.keys.shape[1]
    runner = runners.get(B)
    if runner is None or runner.cache is not cache:
        capture = capture or (capture_cuda_graph if cache.keys.is_cuda else run_eagerly)
        runner = runners[B] = GraphedDecode(model, cache, capture)
    return runner


def forget_graphs(model: Qwen3) -> None:
    """Drop `model`'s captured graphs: after its modules changed (scripts/gpu_check.py switches int8 routes),
    a graph would replay the old kernels."""
    _RUNNERS.pop(model, None)


def can_graph(model: Qwen3) -> bool:
    """A step is one fixed sequence of kernels except in MoE layers, whose experts depend on the data."""
    return not model.config.num_experts
