"""One scheduled step -> one forward of the model -> next-token logits per sequence.

The runner packs the step's chunks, decodes and prompt chunks alike, into one (1, N) sequence of tokens
(batch.py), hands the model their ids, positions and a `PackedView` of the paged pool as its cache
(packed_view.py), and asks for the logits of each row's last token (or of every prompt token, for a
request that scores its prompt). The model is the same one the simple loops use; it never learns that
its cache is paged, or that its batch of one is many sequences.

Attention routes (packed_view.py): "paged" (decodes read in place on a CPU, gathered on a GPU; each prompt
chunk over its gathered blocks), "flex" (a decode step's rows in one FlexAttention call over the pool in
place, compiled per decode bucket, replayed from CUDA graphs on a GPU; steps with prompt rows as "paged"),
and the reference, one gathered row under a block-diagonal mask, for a tensor-parallel model (its workers
rebuild plain views).

The default: "flex" on a GPU, "paged" on a CPU. The first GPU run of "flex" (H100, torch 2.11) failed to
compile (inductor found no tile config dividing the mask's 16 x 16 blocks: flex_paged.kernel_options says
why, and fixes it), so the runner guards it: it warms the smallest bucket up at once (compile, capture),
and if that, or any later bucket's first compile or capture, raises, it logs one line and runs from then on
by the "paged" route, rerunning that step (its keys and values rewritten to the same slots): a failure of
the fast route never fails a request.

Every step is padded up to buckets (buckets.py), so that only a few shapes ever run and the caches keyed by
shape stop growing: a decode step (every row one token) to a bucket of rows, any other step to a bucket of
tokens and of logits rows (batch.py); each prompt row's queries and keys to theirs (packed_view.py). With the
flex route a decode bucket's tables are padded to the widest a sequence can have too, so that a bucket is one
static shape for the compiler; on a GPU each bucket's forward is a CUDA graph, captured on first use and
replayed.

Shapes: N tokens in the step, R rows, M tokens whose logits are kept, V vocab.
"""

import dataclasses
import logging

import torch

from qwen3_scratch.model.qwen3 import Qwen3

from .batch import PackedBatch, decode_padded, pack, step_padded
from .buckets import bucket_for, buckets_up_to, padded_size
from .cuda_graphs import DecodeGraphs
from .packed_view import PackedView, reference_inputs
from .paged_cache import PagedKVCache, PagedView
from .scheduler import ScheduledBatch

log = logging.getLogger("qwen3_scratch.engine")


class ModelRunner:
    def __init__(self, model: Qwen3, cache: PagedKVCache, route: str | None = None, graphs: bool | None = None,
                 max_rows: int = 64, compile_flex: bool | None = None):  # fmt: skip
        """route: "paged", "flex" or "reference" (default: "reference" for a tensor-parallel model, else "flex"
        on a GPU and "paged" on a CPU, as above). graphs: decode steps replay bucket graphs (default: with
        the flex route on a GPU; on a CPU the same code replays the eager forward). compile_flex: compile
        the flex route's attention per bucket (default: on a GPU; a CPU compiles it to C++ when told)."""
        self.model, self.cache = model, cache
        self.device = model.device
        cuda = self.device.type == "cuda"
        self.route = route or ("reference" if not isinstance(model, Qwen3) else "flex" if cuda else "paged")
        self.buckets = buckets_up_to(max_rows)
        self.compile_flex = cuda if compile_flex is None else compile_flex
        use_graphs = (cuda and self.route == "flex" if graphs is None else graphs) and self.route != "reference"
        self.graphs = None
        if use_graphs:
            # a graph reads the RoPE tables at the address of its capture: built now for every position a
            # sequence can reach, they are never rebuilt under a graph (a request longer than any before
            # would otherwise grow them, and the graphs replay over the freed table)
            model.reserve_positions(self.max_width * cache.block_size)
            self.graphs = DecodeGraphs(self._forward, self._view, self._pad_rows, self.buckets, cuda)
        self.prompt_logits: dict[int, torch.Tensor] = {}  # the last run's, see run()
        self.num_forwards = 0
        self.fallback: str | None = None  # why the flex route gave way to "paged", if it did
        if self.route == "flex":
            self.warm_up(1)  # compile and capture the smallest bucket now: a route that fails, fails here

    @torch.no_grad()
    def warm_up(self, rows: int) -> None:
        """The flex route: compile and capture every decode bucket up to `rows` rows, on pad rows alone (they
        touch only the scratch block), so that no later step pays for it. (The other routes run eagerly.)"""
        for bucket in self.buckets:
            if self.route == "flex" and (bucket == 1 or bucket <= rows):
                self._guarded(self._pad_rows(bucket))

    @torch.no_grad()
    def run(self, batch: ScheduledBatch) -> dict[int, torch.Tensor]:
        """Run every chunk in one forward; returns {id(seq): logits (V,)} for the chunks that end at their
        newest token ((1+k, V) for a decode with k proposals: after its newest token and after each), and
        keeps {id(seq): (T, V)} in prompt_logits for those that score their prompt."""
        chunks = batch.decodes + batch.prefills
        scoring = {id(c.seq) for c in batch.prefills if c.seq.wants_prompt_logprobs}
        packed = pack(chunks, self.cache.block_size, self.cache.scratch_block, self.device, scoring)
        logits = self.forward(packed)  # (M, V)
        self.prompt_logits, out, i = {}, {}, 0
        if not scoring and not packed.num_speculative:  # one row a chunk: its views in one call
            return {id(chunk.seq): row for chunk, row in zip(chunks, logits.unbind(0)) if chunk.samples}
        for chunk in chunks:
            n = chunk.end - chunk.start if id(chunk.seq) in scoring else 1 + len(chunk.proposed)
            rows, i = logits[i : i + n], i + n
            if id(chunk.seq) in scoring:
                self.prompt_logits[id(chunk.seq)] = rows
            if chunk.samples:
                out[id(chunk.seq)] = rows if chunk.proposed else rows[-1]
        return out

    def decode(self, chunks: list) -> torch.Tensor:
        """A step of decode chunks alone -> logits (B, V) in their order (what the decode benchmarks time)."""
        logits = self.run(ScheduledBatch(decodes=chunks))
        return torch.stack([logits[id(chunk.seq)] for chunk in chunks])

    def forward(self, packed: PackedBatch) -> torch.Tensor:
        """The logits (M, V) of the packed step's tokens at packed.logits_at."""
        self.num_forwards += 1
        if self.route == "reference":
            blocks, mask = reference_inputs(packed, self.cache.block_size)
            view = PagedView(self.cache, packed.slots[None], blocks)
            return self.model(packed.input_ids, packed.positions, mask, view, packed.slots,
                              logits_at=packed.logits_at)[0]  # fmt: skip
        if packed.num_decodes < packed.num_rows:  # prompt or speculative rows: N and M up to their buckets
            M, bs = len(packed.logits_at), self.cache.block_size
            padded = step_padded(packed, padded_size(packed.num_tokens), padded_size(M), self.cache.scratch_block, bs)
            return self._forward(padded, self._view(padded))[:M]
        return self._guarded(packed) if self.route == "flex" else self._decode(packed)

    def _guarded(self, packed: PackedBatch) -> torch.Tensor:
        """A decode step by the flex route; if compiling or capturing its bucket raises, by "paged" from now on."""
        try:
            return self._decode(packed)
        except Exception as e:  # noqa: BLE001 - any failure of the fast route: the request must not see it
            reason = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"
            log.warning("FlexAttention decode route failed (%s); using the gathered paged route", reason)
            self.route, self.graphs, self.fallback = "paged", None, reason
            return self._decode(packed)

    def _decode(self, packed: PackedBatch) -> torch.Tensor:
        """A decode step (rows of one token): its bucket's graph, else its bucket's padded forward."""
        if self.graphs is not None:
            logits = self.graphs.run(packed)
            if logits is not None:
                return logits
        bucket = bucket_for(packed.num_rows, self.buckets)
        if bucket is None:  # more rows than the largest graph bucket: padded up, by "paged", kept from the compiler
            bs, scratch = self.cache.block_size, self.cache.scratch_block
            padded = decode_padded(packed, padded_size(packed.num_rows), scratch, bs)
            return self._forward(padded, PackedView(self.cache, padded, "paged"))[: packed.num_rows]
        padded = decode_padded(packed, bucket, self.cache.scratch_block, self.cache.block_size)
        if self.route == "flex":  # one static shape per bucket: tables as wide as the graphs' buffers
            extra = self.max_width - padded.tables.shape[1]
            tables = torch.cat([padded.tables, padded.tables.new_full((bucket, extra), self.cache.scratch_block)], 1)
            padded = dataclasses.replace(padded, tables=tables)
        return self._forward(padded, self._view(padded))[: packed.num_rows]

    def _view(self, packed: PackedBatch) -> PackedView:
        return PackedView(self.cache, packed, self.route, self.compile_flex, shapes=len(self.buckets) + 2)

    def _forward(self, packed: PackedBatch, view: PackedView) -> torch.Tensor:
        return self.model(packed.input_ids, packed.positions, None, view, packed.slots, logits_at=packed.logits_at)[0]

    @property
    def max_width(self) -> int:
        """Blocks in the widest table a sequence can have."""
        bs = self.cache.block_size
        return -(-min(self.model.config.max_position_embeddings, self.cache.num_blocks * bs) // bs)

    def _pad_rows(self, rows: int) -> PackedBatch:
        """A decode batch of `rows` pad rows, its tables as wide as a sequence's can grow (the graphs' buffers)."""
        bs, scratch = self.cache.block_size, self.cache.scratch_block
        empty = PackedBatch(*(torch.empty(shape, dtype=torch.long, device=self.device)
                              for shape in ((1, 0), (1, 0), (0,), (0, self.max_width), (0,))),
                            [], [], torch.empty(0, dtype=torch.long, device=self.device), 0, 0)  # fmt: skip
        return decode_padded(empty, rows, scratch, bs)
