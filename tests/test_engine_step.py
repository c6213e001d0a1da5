"""One forward per engine step: packed (varlen) prompts and decodes, bucket padding, graph replay, attention routes.

The references: the simple loop (generation/loops.py), each request run alone, and the reference attention
route (the whole step as one gathered row under a block-diagonal causal mask, the model's own SDPA). fp32,
greedy: tokens must be identical, logits equal within float rounding.
"""

import pytest
import torch
from checkpoints import greedy_alone, one_thread_for_tiny_shapes, random_ids
from make_tiny_checkpoint import make_tiny_checkpoint

from qwen3_scratch import GenerationError, load_model
from qwen3_scratch.engine.batch import decode_padded, pack
from qwen3_scratch.engine.block_manager import BlockManager
from qwen3_scratch.engine.buckets import bucket_for, buckets_up_to, padded_size
from qwen3_scratch.engine.engine import LLMEngine
from qwen3_scratch.engine.llm import gpu_kv_memory_gib
from qwen3_scratch.engine.model_runner import ModelRunner
from qwen3_scratch.engine.packed_view import PackedView
from qwen3_scratch.engine.paged_cache import PagedKVCache
from qwen3_scratch.engine.scheduler import Chunk, ScheduledBatch, Sequence
from qwen3_scratch.sampling.params import SamplingParams

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


one_thread = pytest.fixture(scope="module", autouse=True)(one_thread_for_tiny_shapes)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(make_tiny_checkpoint(tmp_path_factory.mktemp("step") / "tiny"))


def count_forwards(model):
    calls = []
    handle = model.register_forward_hook(lambda module, args, out: calls.append(args[0].shape))
    return calls, handle


def run(engine, prompts, n):
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    out = {str(i): [] for i in range(len(prompts))}
    steps = []
    while engine.has_unfinished():
        steps.append(engine.step())
        for o in steps[-1]:
            out[o.request_id] += o.new_token_ids
    return [out[str(i)] for i in range(len(prompts))]


SHARED = random_ids(20, seed=1)
PROMPTS = [random_ids(5, 2), random_ids(33, 3), SHARED + random_ids(7, 4), random_ids(1, 5), random_ids(12, 6), SHARED + random_ids(3, 7)]


def test_a_step_of_several_prompts_is_one_forward_and_gives_the_simple_loops_tokens(model):
    engine = LLMEngine(model, None, [], num_blocks=64, block_size=8, max_num_batched_tokens=512)
    calls, handle = count_forwards(model)
    try:
        for i, ids in enumerate(PROMPTS):
            engine.add_request(str(i), ids, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
        got = {str(i): [] for i in range(len(PROMPTS))}
        while engine.has_unfinished():
            for out in engine.step():
                got[out.request_id] += out.new_token_ids
            if engine.runner.num_forwards == 1:
                assert len(calls) == 1, f"the first step prefilled {len(PROMPTS)} prompts in {len(calls)} forwards"
                N = padded_size(sum(map(len, PROMPTS)))
                assert calls[0] == (1, N), "one (1, N) forward of every prompt's tokens, padded to a bucket"
    finally:
        handle.remove()
    assert len(calls) == engine.runner.num_forwards == 10, "10 steps (a prefill, 9 decodes), one forward each"
    for i, ids in enumerate(PROMPTS):
        assert got[str(i)] == greedy_alone(model, ids, 10), f"prompt {i} (length {len(ids)}) differs from the simple loop"


def test_packing_does_not_change_tokens_against_each_request_run_through_the_engine_alone(model):
    """Chunked prompts (a budget of 16 tokens) mixed with decodes, a shared prefix: the packed engine's tokens
    equal those of the same engine serving one request at a time (a step of one row, as before packing)."""
    packed = run(LLMEngine(model, None, [], num_blocks=64, block_size=8, max_num_batched_tokens=16), PROMPTS, 10)
    for i, ids in enumerate(PROMPTS):
        one = run(LLMEngine(model, None, [], num_blocks=64, block_size=8, max_num_seqs=1), [ids], 10)[0]
        assert packed[i] == one == greedy_alone(model, ids, 10), f"prompt {i}: packed, alone in the engine, simple loop"


def mixed_step(model, route, block_size=4):
    """A step of three decodes (ragged, one over a shared prefix) and two prompt chunks (one after a cached
    prefix): its logits (M, V) through `route`, from a pool prefilled identically."""
    blocks, cache = BlockManager(32, block_size), PagedKVCache(model.config, 32, block_size)
    runner = ModelRunner(model, cache, route=route)
    lines = [SHARED + [5, 6], random_ids(9, 8), SHARED[:13], random_ids(11, 9), SHARED + random_ids(6, 10)]
    done = [len(lines[0]) - 1, len(lines[1]) - 1, len(lines[2]) - 1, 4, 20]  # tokens already in the cache
    seqs, reference = [], ModelRunner(model, cache, route="reference")
    for i, (ids, n) in enumerate(zip(lines, done)):  # the same prefill for every route, prefix caching on
        seq = Sequence(str(i), ids, len(ids), SamplingParams(), 4, frozenset())
        seq.block_table, cached = blocks.allocate(ids)
        if cached < n:
            reference.run(ScheduledBatch(prefills=[Chunk(seq, cached, n)]))
        blocks.seal_full_blocks(seq.block_table, ids, n)
        seqs.append(seq)
    assert seqs[4].block_table[:5] == seqs[0].block_table[:5], "rows 0 and 4 share the prefix's blocks"
    decodes = [Chunk(seq, n, n + 1) for seq, n in zip(seqs[:3], done)]
    prefills = [Chunk(seqs[3], 4, 11), Chunk(seqs[4], 20, 26)]
    logits = runner.run(ScheduledBatch(decodes, prefills))
    return torch.stack([logits[id(seq)] for seq in seqs])


@pytest.mark.parametrize("route", ["paged", "flex"])
def test_every_attention_route_gives_the_reference_routes_logits(model, route):
    torch.testing.assert_close(mixed_step(model, route), mixed_step(model, "reference"), rtol=1e-5, atol=1e-5,
                               msg=f"{route} route vs one gathered row under a block-diagonal mask")  # fmt: skip


def speculative_step(model, route, block_size=4):
    """A step of two plain decodes, two speculating decodes (k = 1 and 3, one past a block boundary) and a prompt
    chunk: every row's logits, (1+k, V) for the speculating ones, concatenated; and the step's PackedView."""
    blocks, cache = BlockManager(32, block_size), PagedKVCache(model.config, 32, block_size)
    runner, reference = ModelRunner(model, cache, route=route), ModelRunner(model, cache, route="reference")
    lines = [random_ids(6, 30), random_ids(9, 31), random_ids(7, 32), random_ids(14, 33), random_ids(10, 34)]
    proposals = [[], [], [61], [62, 63, 64], []]
    seqs, chunks = [], []
    for i, (ids, proposed) in enumerate(zip(lines, proposals)):
        seq = Sequence(str(i), ids, len(ids), SamplingParams(), 4, frozenset())
        seq.block_table, _ = blocks.allocate(ids)
        done = 3 if i == 4 else len(ids) - 1
        reference.run(ScheduledBatch(prefills=[Chunk(seq, 0, done)]))
        blocks.ensure_capacity(seq.block_table, len(ids) + len(proposed))
        seqs.append(seq)
        chunks.append(Chunk(seq, done, len(ids), list(proposed)))
    views = []
    make_view = runner._view
    runner._view = lambda packed: views.append(make_view(packed)) or views[-1]
    logits = runner.run(ScheduledBatch(chunks[:4], chunks[4:]))
    return torch.cat([logits[id(seq)].view(-1, logits[id(seq)].shape[-1]) for seq in seqs]), views


def test_speculative_rows_attend_in_place_one_query_each_with_the_reference_routes_logits(model):
    """Each query of a speculative row (its newest token, then each proposal) joins the decodes' in-place batch as
    a one-query row over its own row's keys up to its position: logits as the reference route's, every
    position's, and the step's attention is the decodes' one batch plus the prompt chunk."""
    got, views = speculative_step(model, "paged")
    want, _ = speculative_step(model, "reference")
    assert got.shape[0] == 1 + 1 + 2 + 4 + 1
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg="speculative queries in place vs the reference")
    (view,) = views
    assert view.cache.in_place, "the CPU pool reads in place here"
    assert view.num_queries == 2 + 2 + 4 and len(view.prompt_rows) == 1, "speculative rows ran apart from the decodes"


def decode_rows(model, cache, lengths, block_size=4):
    blocks = BlockManager(cache.num_blocks, block_size)
    chunks = []
    for i, n in enumerate(lengths):
        ids = random_ids(n, 20 + i)
        seq = Sequence(str(i), ids, n, SamplingParams(), 4, frozenset())
        seq.block_table, _ = blocks.allocate(ids)
        ModelRunner(model, cache).run(ScheduledBatch(prefills=[Chunk(seq, 0, n - 1)]))
        chunks.append(Chunk(seq, n - 1, n))
    return chunks


def test_pad_rows_change_no_real_rows_logits_and_write_only_the_scratch_block(model):
    cache = PagedKVCache(model.config, 32, 4)
    chunks = decode_rows(model, cache, [7, 12, 3])
    packed = pack(chunks, 4, cache.scratch_block, model.device)
    runner = ModelRunner(model, cache)
    plain = runner._forward(packed, PackedView(cache, packed))  # (3, V)
    before = cache.keys.clone()
    padded = decode_padded(packed, 8, cache.scratch_block, 4)
    assert padded.num_rows == 8 and padded.num_real == 3
    logits = runner._forward(padded, PackedView(cache, padded))  # (8, V)
    torch.testing.assert_close(logits[:3], plain, rtol=1e-5, atol=1e-5, msg="padding changed a real row")
    assert torch.equal(logits[:3].argmax(-1), plain.argmax(-1))
    changed = (cache.keys != before).flatten(3).any(-1).any(0).any(0)  # (slots,) written by the padded step
    real = set(packed.slots.tolist())  # rewritten with the same values by the second forward
    scratch = set(range(cache.scratch_block * 4, cache.scratch_block * 4 + 4))
    assert set(changed.nonzero().flatten().tolist()) <= real | scratch, "a pad row wrote outside the scratch block"


def test_decode_steps_are_padded_to_a_few_buckets(model):
    assert buckets_up_to(64) == [1, 2, 4, 8, 16, 32, 64]
    assert buckets_up_to(200)[-3:] == [160, 192, 200] and buckets_up_to(3) == [1, 2, 3]
    assert [bucket_for(n, [1, 2, 4, 8]) for n in (1, 3, 5, 8, 9)] == [1, 4, 8, 8, None]
    engine = LLMEngine(model, None, [], num_blocks=64, block_size=8)
    calls, handle = count_forwards(model)
    try:
        run(engine, PROMPTS[:5], 3)
    finally:
        handle.remove()
    assert calls[0] == (1, padded_size(sum(map(len, PROMPTS[:5])))), "the first step prefills every prompt"
    decode_shapes = set(calls[1:])
    assert decode_shapes == {(1, 8)}, f"5 decode rows run as the bucket of 8, not {decode_shapes}"


def test_replayed_graphs_give_the_simple_loops_tokens_and_capture_once_per_bucket(model):
    """On a CPU the graph runner replays the eager forward over the same static buffers: what it proves is
    the copy-in of the real rows, the reset padding, and the slicing out, across steps of different sizes."""
    engine = LLMEngine(model, None, [], num_blocks=64, block_size=8, max_num_batched_tokens=24)
    engine.runner = ModelRunner(model, engine.cache, graphs=True, max_rows=engine.scheduler.max_num_seqs)
    lengths = [6, 14, 9, 11, 3]
    for i, ids in enumerate(PROMPTS[:5]):
        engine.add_request(str(i), ids, SamplingParams(temperature=0, max_tokens=lengths[i], ignore_eos=True))
    got = {str(i): [] for i in range(5)}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
    graphs = engine.runner.graphs
    assert graphs.replays > 10 and set(graphs.graphs) >= {2, 4, 8}, "decode steps of 8, 4, 2 rows replayed"
    for i, ids in enumerate(PROMPTS[:5]):
        assert got[str(i)] == greedy_alone(model, ids, lengths[i]), f"prompt {i} differs from the simple loop"


def test_a_runner_with_graphs_builds_the_rope_tables_for_every_position_first(model):
    """A graph reads the RoPE tables where they were at its capture: they must never be rebuilt longer
    under it (a request longer than any before would do that, and the graphs replay over the freed table)."""
    model.build_rope_tables(model.device, None, 64)  # as a fresh load has them: short
    cache = PagedKVCache(model.config, 64, 8)
    runner = ModelRunner(model, cache, graphs=True)
    longest = min(model.config.max_position_embeddings, cache.num_blocks * cache.block_size)
    assert runner.max_width * cache.block_size >= longest
    assert model.rope_cos.shape[0] >= longest, "the tables cover any sequence before the first capture"
    table = model.rope_cos
    engine = LLMEngine(model, None, [], num_blocks=64, block_size=8)
    engine.runner = runner
    engine.add_request("long", PROMPTS[0], SamplingParams(temperature=0, max_tokens=longest - len(PROMPTS[0])))
    assert model.rope_cos is table, "adding the longest request left the tables where the graphs read them"


def test_the_flex_block_mask_reads_the_buffers_a_graph_refreshes(model):
    cache = PagedKVCache(model.config, 32, 4)
    packed = pack(decode_rows(model, cache, [7, 12]), 4, cache.scratch_block, model.device)
    flex = PackedView(cache, packed, "flex").flex
    mask = flex.block_mask
    assert mask.kv_indices.data_ptr() == flex.kv[1].data_ptr(), "refresh must rewrite what the mask reads"
    assert mask.full_kv_indices.data_ptr() == flex.kv[3].data_ptr()


def test_the_gpu_kv_pool_takes_what_the_memory_utilization_leaves(model, monkeypatch):
    GIB = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (60 * GIB, 80 * GIB))  # 20 GiB in use
    c = model.config
    step = 512 * (3 * c.intermediate_size * 4 + c.vocab_size * 4) / GIB  # one step's widest activations, fp32
    got = gpu_kv_memory_gib(c, "cuda", 0.9, 512, 4)
    assert got == pytest.approx(0.9 * 80 - 20 - 2 * step), "90% of the card, less what is used and the activations"
    with pytest.raises(GenerationError, match="gpu_memory_utilization=0.2"):
        gpu_kv_memory_gib(c, "cuda", 0.2, 512, 4)  # 16 GiB allowed, 20 already used


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.cuda
@cuda
def test_on_a_gpu_graphs_and_flex_attention_give_the_simple_loops_tokens(tmp_path):
    model = load_model(make_tiny_checkpoint(tmp_path / "tiny"), device="cuda")
    engine = LLMEngine(model, None, [], num_blocks=64, block_size=16, max_num_batched_tokens=32)
    runner = engine.runner
    assert runner.fallback is None, f"the GPU default, flex, fell back to the gathered route: {runner.fallback}"
    assert runner.route == "flex" and runner.graphs is not None, "the GPU default: flex, decode graphs replayed"
    got = run(engine, PROMPTS, 12)
    assert engine.runner.graphs.replays > 0
    for i, ids in enumerate(PROMPTS):
        assert got[i] == greedy_alone(model, ids, 12), f"prompt {i} differs from the simple loop on the GPU"
