"""The engine's FlexAttention route compiled as a GPU runs it: per decode bucket, static shapes, and guarded.

On a CPU inductor compiles flex_attention to C++ (not Triton), but from the same graph: the same static
shapes per bucket, the same block mask over the pool in place, the same dynamo recompiles. So what the
first H100 run failed at (a shape the compiler could not take) is checked here for real, fp32 and greedy,
against the simple loop and the gathered route; what only the Triton template checks (its tiles must
divide the mask's blocks) is checked against the rule it applies. And when compiling or capturing raises
anyway, the runner falls back to the gathered route without failing a request.
"""

import logging

import pytest
import torch
from checkpoints import greedy_alone, one_thread_for_tiny_shapes, random_ids
from make_tiny_checkpoint import make_tiny_checkpoint

from qwen3_scratch import load_model
from qwen3_scratch.engine import flex_paged
from qwen3_scratch.engine.batch import pack
from qwen3_scratch.engine.block_manager import BlockManager
from qwen3_scratch.engine.engine import LLMEngine
from qwen3_scratch.engine.model_runner import ModelRunner
from qwen3_scratch.engine.packed_view import PackedView
from qwen3_scratch.engine.paged_cache import PagedKVCache
from qwen3_scratch.engine.scheduler import Chunk, ScheduledBatch, Sequence
from qwen3_scratch.sampling.params import SamplingParams

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
one_thread = pytest.fixture(scope="module", autouse=True)(one_thread_for_tiny_shapes)
BLOCK = 16  # the engine's default block size, and the GPU template's smallest tile


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(make_tiny_checkpoint(tmp_path_factory.mktemp("flex") / "tiny"))


PROMPTS = [random_ids(5, 2), random_ids(37, 3), random_ids(20, 4) + random_ids(3, 5), random_ids(1, 6), random_ids(18, 7)]
NEW = [9, 4, 12, 6, 3]  # ragged ends: decode steps of 5, 4, 3, 2 and 1 rows (buckets 8, 4, 4, 2, 1)


def serve(model, **runner):
    """PROMPTS through an engine whose runner is ModelRunner(**runner): (tokens per prompt, the runner)."""
    engine = LLMEngine(model, None, [], num_blocks=48, block_size=BLOCK, max_num_seqs=8)
    engine.runner = ModelRunner(model, engine.cache, max_rows=8, **runner)
    for i, (ids, n) in enumerate(zip(PROMPTS, NEW)):
        engine.add_request(str(i), ids, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    got = {str(i): [] for i in range(len(PROMPTS))}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
    return [got[str(i)] for i in range(len(PROMPTS))], engine.runner


def compiled_entries():
    """dynamo's cache of compiled flex_attention frames (one per static shape it compiled)."""
    return torch._dynamo.eval_frame._debug_get_cache_entry_list(flex_paged.flex_attention.__code__)


def test_compiled_flex_decode_buckets_give_the_simple_loops_tokens_one_compile_per_bucket(model, monkeypatch):
    shapes = []
    real = flex_paged.compiled_flex

    def recording(device, limit):
        compiled = real(device, limit)
        return lambda q, *args, **kwargs: shapes.append(tuple(q.shape)) or compiled(q, *args, **kwargs)

    monkeypatch.setattr(flex_paged, "compiled_flex", recording)
    before = len(compiled_entries())
    got, runner = serve(model, route="flex", graphs=True, compile_flex=True)
    compiles = len(compiled_entries()) - before
    assert runner.route == "flex" and runner.fallback is None, f"the compiled route fell back: {runner.fallback}"
    for i, (ids, n) in enumerate(zip(PROMPTS, NEW)):
        assert got[i] == greedy_alone(model, ids, n), f"prompt {i}: compiled flex decode vs the simple loop"
    assert set(runner.graphs.graphs) == {1, 2, 4, 8}, "every decode step ran as one of its buckets' graphs"
    queries = {s[2] for s in shapes}
    assert queries == {16, 32, 64, 128}, f"a bucket of b rows is b query blocks of 16, not {sorted(queries)}"
    assert compiles <= len(queries), f"{compiles} compiles for {len(queries)} static shapes (a recompile per step?)"


def decode_step(model, cache, lengths):
    """Decode chunks of len(lengths) rows, two over a shared prefix, their prompts prefilled by the reference."""
    blocks, reference = BlockManager(cache.num_blocks, BLOCK), ModelRunner(model, cache, route="reference")
    shared, chunks = random_ids(40, 11), []
    for i, n in enumerate(lengths):
        ids = shared[:n] if i < 2 else random_ids(n, 30 + i)
        seq = Sequence(str(i), ids, n, SamplingParams(), 4, frozenset())
        seq.block_table, cached = blocks.allocate(ids)
        if cached < n - 1:
            reference.run(ScheduledBatch(prefills=[Chunk(seq, cached, n - 1)]))
        blocks.seal_full_blocks(seq.block_table, ids, n - 1)
        chunks.append(Chunk(seq, n - 1, n))
    return chunks


def test_compiled_flex_logits_equal_the_gathered_routes_in_fp32(model):
    cache = PagedKVCache(model.config, 40, BLOCK)
    chunks = decode_step(model, cache, [40, 35, 17, 1, 64])
    compiled = ModelRunner(model, cache, route="flex", graphs=False, compile_flex=True, max_rows=8).decode(chunks)
    gathered = ModelRunner(model, cache, route="reference").decode(chunks)
    torch.testing.assert_close(compiled, gathered, rtol=1e-5, atol=1e-5, msg="compiled flex vs the gathered row")
    assert torch.equal(compiled.argmax(-1), gathered.argmax(-1))


def test_a_flex_compile_that_raises_at_warm_up_falls_back_with_one_log_line(model, monkeypatch, caplog):
    def broken(device, limit):
        raise RuntimeError("NoValidChoicesError: No choices to select\nsecond line")

    monkeypatch.setattr(flex_paged, "compiled_flex", broken)
    with caplog.at_level(logging.WARNING, logger="qwen3_scratch.engine"):
        got, runner = serve(model, route="flex", graphs=True, compile_flex=True)
    assert runner.route == "paged" and runner.graphs is None, "the runner must leave the route that failed"
    assert runner.fallback == "RuntimeError: NoValidChoicesError: No choices to select", runner.fallback
    lines = [r.getMessage() for r in caplog.records if r.name == "qwen3_scratch.engine"]
    assert len(lines) == 1 and "using the gathered paged route" in lines[0], lines
    for i, (ids, n) in enumerate(zip(PROMPTS, NEW)):
        assert got[i] == greedy_alone(model, ids, n), f"prompt {i} after the fallback"


def test_a_bucket_that_fails_later_reruns_its_step_by_the_gathered_route(model, monkeypatch, caplog):
    """Bucket 1 compiles at warm-up; the first step of 5 rows (bucket 8) raises inside its capture: that step
    is rerun by the paged route (its keys rewritten to the same slots) and every request still completes."""

    def fails_above_one_row(device, limit):
        return lambda q, *a, **k: (_ for _ in ()).throw(RuntimeError("capture failed")) if q.shape[2] > 16 else \
            flex_paged.flex_attention(q, *a, **k)  # fmt: skip

    monkeypatch.setattr(flex_paged, "compiled_flex", fails_above_one_row)
    with caplog.at_level(logging.WARNING, logger="qwen3_scratch.engine"):
        got, runner = serve(model, route="flex", graphs=True, compile_flex=True)
    assert runner.fallback == "RuntimeError: capture failed" and runner.route == "paged"
    assert len([r for r in caplog.records if r.name == "qwen3_scratch.engine"]) == 1
    for i, (ids, n) in enumerate(zip(PROMPTS, NEW)):
        assert got[i] == greedy_alone(model, ids, n), f"prompt {i}: the step that failed was not rerun exactly"


def test_the_gpu_templates_tiles_divide_the_mask_blocks():
    """Inductor's Triton template drops every tile config whose BLOCK_M does not divide the query block and
    whose BLOCK_N does not divide the KV block (torch/_inductor/kernel/flex/flex_attention.py); the route's
    options must survive that rule, and block sizes it cannot tile must be refused before a compile."""
    options = flex_paged.kernel_options(16, BLOCK)
    assert 16 % options["BLOCK_M"] == 0 and BLOCK % options["BLOCK_N"] == 0
    assert options["FORCE_USE_FLEX_ATTENTION"], "the decode kernel's BLOCK_M (queries x GQA group) would not divide 16"
    flex_paged.check_block_sizes(16, 32)
    for bad in (8, 24):
        with pytest.raises(ValueError, match=f"KV block_size that is a power of two >= 16, not {bad}"):
            flex_paged.check_block_sizes(16, bad)


def test_a_prompt_step_by_the_flex_route_leaves_flex_to_the_decode_buckets(model):
    cache = PagedKVCache(model.config, 16, BLOCK)
    seq = Sequence("0", random_ids(20, 1), 20, SamplingParams(), 4, frozenset())
    seq.block_table, _ = BlockManager(16, BLOCK).allocate(seq.token_ids)
    packed = pack([Chunk(seq, 0, 20)], BLOCK, cache.scratch_block, model.device)
    assert PackedView(cache, packed, "flex").flex is None, "a prompt's length would be a new shape every step"
