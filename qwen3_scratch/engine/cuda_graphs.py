"""Decode steps replayed from CUDA graphs, one per batch-size bucket (nano-vllm's model_runner, vLLM's).

An eager decode step of a 0.6B model on a GPU is ~1,100 kernel launches of a few microseconds of work
each: the host, not the GPU, sets the pace. A CUDA graph records the launches of one forward once and
replays them with one call. A graph replays fixed shapes at fixed addresses, so:

  - a step of B rows runs in the graph of the smallest bucket >= B (1, 2, 4, 8, 16, 32, then steps of 32
    up to max_num_seqs: buckets.py, the policy all step shapes follow), padded with rows that touch only
    the scratch block (batch.py says why they cannot change a real row); a step above the largest bucket,
    or with prompt rows, runs eagerly (padded all the same, batch.step_padded);
  - each bucket's inputs live in static buffers: a PackedBatch whose tensors the graph read at capture.
    A replay copies the real rows in (ids, positions, slots, block tables, context lengths), resets the
    padding, replays, and slices the real rows' logits out. The block tables are as wide as the widest
    table a sequence can have, so any context fits; the attention visits only a row's own blocks;
  - what the attention derives from those inputs (the FlexAttention block mask, the valid slots) is
    computed inside the graph from the buffers (`PackedView.refresh`), never on the host.

On a CPU there are no graphs, but the same class runs with `Recorded` in place of torch.cuda.CUDAGraph:
it "captures" the eager forward over the same static buffers and "replays" it by calling it again, so
the bucket choice, the copy-in, the padding and the slicing out are what the CPU tests exercise.

Shapes: b bucket rows, R real rows (<= b), Wmax blocks per table, V vocab.
"""

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .batch import PackedBatch
from .buckets import bucket_for, buckets_up_to  # noqa: F401 (the bucketing policy lives in buckets.py)


class Recorded:
    """A stand-in for torch.cuda.CUDAGraph where there is no GPU: replay() calls the captured step again.

    Like a CUDA graph, it keeps nothing alive: it holds its step weakly, so whoever captured must keep the
    step, and through it the view and buffers it reads (`Captured`). A CUDA graph replays raw addresses;
    a view dropped after its capture lets the allocator hand its tensors to others, and the replay reads
    whatever is there (the first H200 run's index out of bounds, after a 64-row bucket's capture reused
    the 32-row bucket's freed mask buffers). Here such a capture fails its first replay instead."""

    def __init__(self, step: Callable[[], torch.Tensor], out: torch.Tensor):
        self.step, self.out = weakref.ref(step), out

    def replay(self) -> None:
        step = self.step()
        if step is None:
            raise RuntimeError("a recorded step was replayed after its captor dropped it")
        self.out.copy_(step())


@dataclass
class Captured:
    """One bucket's graph and everything its replays read: the static batch, and the step that refreshes the
    cache view made from it and runs the forward (the step holds that view, and with it the mask buffers)."""

    graph: "torch.cuda.CUDAGraph | Recorded"
    static: PackedBatch
    step: Callable[[], torch.Tensor]
    logits: torch.Tensor  # the graph's output buffer (b, V)


class DecodeGraphs:
    """forward(batch) -> logits (rows, V) of a PackedBatch; `run` replays it from its bucket's graph."""

    def __init__(self, forward: Callable[[PackedBatch], torch.Tensor], make_view: Callable, template: Callable,
                 buckets: list[int], use_cuda: bool):  # fmt: skip
        """make_view(batch): the cache view the forward reads; template(rows): a padded batch of `rows` pad rows."""
        self.forward, self.make_view, self.template = forward, make_view, template
        self.buckets, self.use_cuda = buckets, use_cuda
        self.graphs: dict[int, Captured] = {}  # bucket -> its graph and what the graph reads
        self.pads: dict[int, PackedBatch] = {}  # bucket -> its batch of pad rows only
        self.pool = None  # the CUDA graphs share one memory pool: they never run at once
        self.replays = 0  # (tests, metrics)

    def run(self, batch: PackedBatch) -> torch.Tensor | None:
        """The decode batch's logits (R, V) from its bucket's graph, captured on first use; None if no bucket fits."""
        bucket = bucket_for(batch.num_rows, self.buckets)
        if bucket is None or batch.num_decodes != batch.num_rows:
            return None
        if bucket not in self.graphs:
            self.graphs[bucket] = self.capture(bucket)
        captured = self.graphs[bucket]
        self.copy_in(captured.static, batch)
        captured.graph.replay()
        self.replays += 1
        return captured.logits[: batch.num_rows].clone()  # the next replay overwrites the graph's output

    def copy_in(self, static: PackedBatch, batch: PackedBatch) -> None:
        """Real rows into the static buffers; the rows after them back to padding (the pad template's values)."""
        R, W = batch.tables.shape
        pad = self.pads[static.num_rows]
        for name in ("input_ids", "positions", "slots", "tables", "context_lens"):
            getattr(static, name).copy_(getattr(pad, name))
        static.input_ids[:, :R] = batch.input_ids
        static.positions[:, :R] = batch.positions
        static.slots[:R] = batch.slots
        static.context_lens[:R] = batch.context_lens
        static.tables[:R, :W] = batch.tables

    def capture(self, bucket: int) -> Captured:
        static, self.pads[bucket] = self.template(bucket), self.template(bucket)
        view = self.make_view(static)

        def step():
            view.refresh()
            return self.forward(static, view)

        if not self.use_cuda:
            out = step()
            return Captured(Recorded(step, out), static, step, out)
        step()  # warm up outside the graph: compiles, autotunes, allocates lazily made state
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = step()
        self.pool = graph.pool()
        return Captured(graph, static, step, out)
