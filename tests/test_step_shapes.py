"""Bounded step shapes (engine/buckets.py): every engine step is padded up to a few sizes, and the padding
changes no token. Mixed steps at odd sizes against the reference route (never padded) and the simple loop;
a randomized workload's forwards against the bucket count."""

import random

import pytest
import torch
from checkpoints import greedy_alone, one_thread_for_tiny_shapes, random_ids
from make_tiny_checkpoint import make_tiny_checkpoint

from qwen3_scratch import load_model
from qwen3_scratch.engine.batch import pack
from qwen3_scratch.engine.block_manager import BlockManager
from qwen3_scratch.engine.buckets import num_buckets, padded_size
from qwen3_scratch.engine.engine import LLMEngine
from qwen3_scratch.engine.model_runner import ModelRunner
from qwen3_scratch.engine.packed_view import PackedView
from qwen3_scratch.engine.paged_cache import PagedKVCache
from qwen3_scratch.engine.scheduler import Chunk, ScheduledBatch, Sequence
from qwen3_scratch.sampling.params import SamplingParams

one_thread = pytest.fixture(scope="module", autouse=True)(one_thread_for_tiny_shapes)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(make_tiny_checkpoint(tmp_path_factory.mktemp("shapes") / "tiny"))


def test_padding_a_mixed_step_at_odd_sizes_changes_no_logit_and_writes_only_the_scratch_block(model):
    """Three decodes, prompt chunks of 13 and 21 tokens (one after a cached prefix of 7): N = 37 runs as 64 (each
    chunk's attention keeps its exact queries and keys: packed_view.prompt_row says why). The reference route runs the same
    step unpadded (one gathered row under a block-diagonal mask)."""
    bs = 4
    blocks, cache = BlockManager(40, bs), PagedKVCache(model.config, 40, bs)
    lines = [random_ids(9, 1), random_ids(17, 2), random_ids(6, 3), random_ids(13, 4), random_ids(28, 5)]
    done = [8, 16, 5, 0, 7]  # tokens already in the cache
    seqs, reference = [], ModelRunner(model, cache, route="reference")
    for i, (ids, n) in enumerate(zip(lines, done)):
        seq = Sequence(str(i), ids, len(ids), SamplingParams(), 4, frozenset())
        seq.block_table, _ = blocks.allocate(ids, use_cache=False)
        if n:
            reference.run(ScheduledBatch(prefills=[Chunk(seq, 0, n)]))
        seqs.append(seq)
    decodes = [Chunk(s, n, n + 1) for s, n in zip(seqs[:3], done)]
    step = ScheduledBatch(decodes, [Chunk(seqs[3], 0, 13), Chunk(seqs[4], 7, 28)])
    before = cache.keys.clone()
    want = reference.run(step)
    after_reference = cache.keys.clone()
    shapes = []
    runner = ModelRunner(model, cache)
    handle = model.register_forward_hook(lambda module, args, out: shapes.append(tuple(args[0].shape)))
    try:
        got = runner.run(step)
    finally:
        handle.remove()
    assert shapes == [(1, 64)], f"the step of 37 tokens runs as its bucket of 64, not {shapes}"
    for i, seq in enumerate(seqs):
        torch.testing.assert_close(got[id(seq)], want[id(seq)], rtol=1e-5, atol=1e-5, msg=f"row {i} changed by padding")
        assert got[id(seq)].argmax() == want[id(seq)].argmax(), f"row {i}'s greedy token changed by padding"
    changed = (cache.keys != after_reference).flatten(3).any(-1).any(0).any(0).nonzero().flatten().tolist()
    real = pack(step.decodes + step.prefills, bs, cache.scratch_block, model.device).slots.tolist()  # rewritten
    scratch = range(cache.scratch_block * bs, (cache.scratch_block + 1) * bs)
    assert set(changed) <= set(real) | set(scratch), "the padded step wrote outside its slots and the scratch block"
    assert (after_reference != before).any(), "the step wrote its real keys"


def run(engine, requests, steps_between=0):
    """requests: (prompt, max_tokens), one added every `steps_between` steps; -> each one's tokens."""
    out, pending, step = {}, list(enumerate(requests)), 0
    while pending or engine.has_unfinished():
        if pending and step % (steps_between or 1) == 0:
            i, (ids, n) = pending.pop(0)
            engine.add_request(str(i), ids, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
            out[str(i)] = []
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
        step += 1
    return [out[str(i)] for i in range(len(requests))]


QUOTING = random_ids(6, 9) * 4  # repeats itself: prompt lookup finds proposals
ODD = [(random_ids(5, 10), 7), (random_ids(33, 11), 9), (QUOTING, 11), (random_ids(1, 12), 5), (random_ids(19, 13), 13)]


@pytest.mark.parametrize("speculative", [None, {"method": "ngram", "num_speculative_tokens": 3}])
def test_padded_steps_at_odd_sizes_give_the_simple_loops_tokens(model, speculative):
    """A budget of 13 tokens chunks every prompt at odd lengths beside the decodes; requests arrive every other
    step; with prompt lookup, rows of 1 + k tokens join the step. Every step is padded, no token changes."""
    engine = LLMEngine(model, None, [], num_blocks=64, block_size=8, max_num_batched_tokens=13,
                       speculative_config=speculative)  # fmt: skip
    got = run(engine, ODD, steps_between=2)
    if speculative:
        assert engine.speculator.num_proposed > 0, "the quoting prompt made prompt lookup propose"
    for i, (ids, n) in enumerate(ODD):
        assert got[i] == greedy_alone(model, ids, n), f"request {i} (prompt of {len(ids)}) differs from the simple loop"


def random_workload(seed, count):
    rng = random.Random(seed)
    quote = random_ids(5, seed)
    return [((quote * 5)[: rng.randint(8, 25)] if rng.random() < 0.3 else random_ids(rng.randint(1, 70), seed + i),
             rng.randint(1, 24)) for i in range(count)]  # fmt: skip


def test_a_random_workload_runs_no_more_shapes_than_there_are_buckets(model, monkeypatch):
    """Prompts of 1-70 tokens, 1-24 new tokens, arriving every step, prompt lookup on: the forwards' token
    counts and logits rows take bucket sizes only, and fewer distinct values than the unpadded steps would
    have; each prompt row attends with its exact (queries, keys), which keeps the simple loop's bits."""
    engine = LLMEngine(model, None, [], num_blocks=96, block_size=8, max_num_batched_tokens=48, max_num_seqs=8,
                       speculative_config={"method": "ngram", "num_speculative_tokens": 3})  # fmt: skip
    real, padded, rows = set(), set(), set()
    forward, prompt_row = engine.runner.forward, PackedView.prompt_row

    def counted_forward(packed):
        real.add(packed.num_tokens)
        return forward(packed)

    def counted_row(self, r, offset):
        row = prompt_row(self, r, offset)
        offset, n, mask, _ = row
        rows.add((n, tuple(mask.shape[-2:]), self.batch.starts[r] + n))  # chunk length, mask (T, S), the row's end
        return row

    monkeypatch.setattr(engine.runner, "forward", counted_forward)
    monkeypatch.setattr(PackedView, "prompt_row", counted_row)
    handle = engine.model.register_forward_hook(lambda m, args, kwargs, out: padded.add(
        (args[0].shape[1], len(kwargs["logits_at"]))), with_kwargs=True)  # fmt: skip
    try:
        run(engine, random_workload(0, 40))
    finally:
        handle.remove()
    tokens, logits = {n for n, _ in padded}, {m for _, m in padded}
    assert all(padded_size(n) == n for n in tokens | logits), f"a step ran off the buckets: {sorted(padded)}"
    assert len(tokens) <= num_buckets(max(real)), f"{len(tokens)} token counts for {num_buckets(max(real))} buckets"
    assert len(real) > len(tokens), f"the workload's {len(real)} step sizes should need padding to {len(tokens)}"
    assert rows and all(mask == (n, end) for n, mask, end in rows), "a prompt row's attention was padded"
