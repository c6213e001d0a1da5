"""The serving engine: block manager, scheduler, paged cache and continuous batching, against the simple loop.

The simple loop (generate.generate_tokens) is the reference: whatever the engine does with blocks,
chunks, batches and preemption, a greedy request's tokens must be the ones it gets run alone.
"""

import pytest
import torch
from checkpoints import one_thread_for_tiny_shapes
from make_tiny_checkpoint import make_tiny_checkpoint

from qwen3_scratch import GenerationError, load_model
from qwen3_scratch.engine.block_manager import BlockManager
from qwen3_scratch.engine.engine import LLMEngine
from qwen3_scratch.engine.llm import LLM
from qwen3_scratch.engine.model_runner import ModelRunner
from qwen3_scratch.engine.paged_cache import PagedKVCache
from qwen3_scratch.engine.scheduler import Chunk, ScheduledBatch, Scheduler, Sequence, Status
from qwen3_scratch.generation.loops import generate_tokens
from qwen3_scratch.sampling.logits import LogitsFilter
from qwen3_scratch.sampling.params import SamplingParams
from qwen3_scratch.text.tokenizer import Tokenizer

GREEDY = LogitsFilter(temperature=0.0)


one_thread = pytest.fixture(scope="module", autouse=True)(one_thread_for_tiny_shapes)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("engine") / "tiny")


@pytest.fixture(scope="module")
def model(checkpoint):
    return load_model(checkpoint)


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    return Tokenizer.from_checkpoint(checkpoint)


def prompt(length, seed):
    return torch.randint(3, 1000, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def alone(model, ids, max_tokens, eos=()):
    """The reference: one request through the simple KV-cache loop."""
    return [int(t[0]) for t in generate_tokens(model, [ids], max_tokens, GREEDY, list(eos))]


def run_engine(engine, requests):
    """requests: {id: (ids, params)}, all added up front -> {id: output token ids} (also of earlier requests)."""
    for request_id, (ids, params) in requests.items():
        engine.add_request(request_id, ids, params)
    outputs = {request_id: [] for request_id in requests}
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
    return outputs


# -- block manager ---------------------------------------------------------------------------------


def test_shared_prefix_blocks_are_reference_counted_and_hash_chained():
    blocks = BlockManager(num_blocks=8, block_size=4)
    a_ids = list(range(10))  # 2 full blocks + 2 tokens
    table_a, cached = blocks.allocate(a_ids)
    assert cached == 0 and len(table_a) == 3
    blocks.seal_full_blocks(table_a, a_ids, num_written=10)
    b_ids = list(range(8)) + [99, 98, 97]  # same first 2 blocks, different tail
    table_b, cached = blocks.allocate(b_ids)
    assert table_b[:2] == table_a[:2] and cached == 8, "the two full prefix blocks are shared"
    assert [blocks.blocks[i].ref_count for i in table_a] == [2, 2, 1]
    c_ids = [0, 1, 2, 3, 9, 9, 9, 9, 9]
    assert blocks.cached_prefix(c_ids) == table_a[:1], "a different 2nd block breaks the chain there"
    d_ids = [7, 7, 7, 7] + list(range(4, 8)) + [1]
    assert blocks.cached_prefix(d_ids) == [], "block 2's hash covers block 1's tokens too: no match without them"
    blocks.free_table(table_b)
    assert [blocks.blocks[i].ref_count for i in table_a] == [1, 1, 1] and table_b == [], "freed tables are emptied"
    assert blocks.num_used == 3


def test_sealing_step_by_step_gives_the_hashes_of_sealing_at_once():
    """seal_full_blocks walks only the blocks after the last sealed one: a sequence sealed after every token, and
    one whose prefix came from the cache, hold the hashes of the same tokens sealed in one call."""
    ids = [(7 * i) % 13 for i in range(27)]
    once = BlockManager(num_blocks=16, block_size=4)
    table_once, _ = once.allocate(ids)
    once.seal_full_blocks(table_once, ids, len(ids))
    expected = [once.blocks[i].hash for i in table_once]
    stepwise = BlockManager(num_blocks=16, block_size=4)
    table, _ = stepwise.allocate(ids[:1])
    for n in range(1, len(ids) + 1):
        assert stepwise.ensure_capacity(table, n)
        stepwise.seal_full_blocks(table, ids[:n], n)
    assert [stepwise.blocks[i].hash for i in table] == expected
    shared, cached = stepwise.allocate(ids[:14] + [99, 98, 97, 96, 95, 94])  # 3 cached blocks, then new ones
    assert cached == 12
    stepwise.seal_full_blocks(shared, ids[:14] + [99, 98, 97, 96, 95, 94], 20)
    alone = BlockManager(num_blocks=16, block_size=4)
    fresh, _ = alone.allocate(ids[:14] + [99, 98, 97, 96, 95, 94])
    alone.seal_full_blocks(fresh, ids[:14] + [99, 98, 97, 96, 95, 94], 20)
    assert [stepwise.blocks[i].hash for i in shared] == [alone.blocks[i].hash for i in fresh]


def test_the_last_token_is_never_served_from_the_cache():
    blocks = BlockManager(num_blocks=4, block_size=4)
    ids = list(range(8))
    table, _ = blocks.allocate(ids)
    blocks.seal_full_blocks(table, ids, 8)
    assert blocks.cached_prefix(ids) == table[:1], "the block holding the last token is recomputed"


def test_freed_blocks_stay_cached_until_evicted_least_recently_used_first():
    blocks = BlockManager(num_blocks=4, block_size=2)
    first, second = [1, 2, 3], [5, 6, 7]
    t1, _ = blocks.allocate(first)
    blocks.seal_full_blocks(t1, first, 3)
    blocks.free_table(t1)
    t2, _ = blocks.allocate(second)
    blocks.seal_full_blocks(t2, second, 3)
    blocks.free_table(t2)
    assert blocks.num_free == 4
    assert blocks.cached_prefix(first) and blocks.cached_prefix(second), "freed full blocks keep their hashes"
    blocks.allocate_block(), blocks.allocate_block()  # the two unhashed tail blocks go first
    assert blocks.cached_prefix(first) and blocks.cached_prefix(second)
    blocks.allocate_block()  # now the least recently used hashed block: first's
    assert not blocks.cached_prefix(first) and blocks.cached_prefix(second)


def test_a_cache_hit_revives_a_freed_block_and_admission_counts_it():
    blocks = BlockManager(num_blocks=2, block_size=2)
    ids = [1, 2, 3]
    table, _ = blocks.allocate(ids)
    blocks.seal_full_blocks(table, ids, 3)
    first_block = table[0]
    blocks.free_table(table)
    assert blocks.can_allocate(ids) and not blocks.can_allocate(ids, reserve=1)
    again, cached = blocks.allocate(ids)
    assert cached == 2 and again[0] == first_block and blocks.num_free == 0


# -- scheduler -------------------------------------------------------------------------------------


def make_seq(request_id, n, max_tokens=8):
    return Sequence(request_id, list(range(100, 100 + n)), n, SamplingParams(max_tokens=max_tokens), max_tokens,
                    frozenset())  # fmt: skip


def test_admission_stops_when_the_pool_has_no_blocks_left():
    scheduler = Scheduler(BlockManager(num_blocks=4, block_size=4), max_num_batched_tokens=64)
    for i in range(3):
        scheduler.add(make_seq(str(i), 6))  # 2 blocks each
    batch = scheduler.schedule()
    assert [c.seq.request_id for c in batch.prefills] == ["0"], "the 2nd needs 2 blocks + 1 spare; 2 are left"
    assert [s.request_id for s in scheduler.waiting] == ["1", "2"]


def test_long_prompts_are_chunked_and_decodes_go_first():
    scheduler = Scheduler(BlockManager(num_blocks=64, block_size=4), max_num_batched_tokens=10)
    short, long = make_seq("short", 3), make_seq("long", 30)
    scheduler.add(short)
    scheduler.add(long)
    batch = scheduler.schedule()
    assert [(c.seq.request_id, c.start, c.end) for c in batch.prefills] == [("short", 0, 3), ("long", 0, 7)]
    for chunk in batch.prefills:
        scheduler.computed(chunk)
    short.token_ids.append(1)  # short sampled its first token
    batch = scheduler.schedule()
    assert [(c.seq.request_id, c.start, c.end) for c in batch.decodes] == [("short", 3, 4)]
    assert [(c.seq.request_id, c.start, c.end) for c in batch.prefills] == [("long", 7, 16)], (
        "the long prompt gets what the decode left of the 10-token budget"
    )


def test_a_decode_without_a_free_block_preempts_the_newest_request():
    scheduler = Scheduler(BlockManager(num_blocks=3, block_size=2), max_num_batched_tokens=64)
    old, new = make_seq("old", 2), make_seq("new", 2)
    scheduler.add(old)
    scheduler.add(new)
    for chunk in scheduler.schedule().prefills:
        scheduler.computed(chunk)
    old.token_ids.append(1), new.token_ids.append(1)  # both need a 2nd block now; one is free
    batch = scheduler.schedule()
    assert [c.seq.request_id for c in batch.decodes] == ["old"]
    assert batch.preempted == [new] and new.status is Status.WAITING and new.num_computed == 0
    assert scheduler.waiting[0] is new and new.block_table == [], "back at the front, blocks freed"


# -- paged cache and runner ------------------------------------------------------------------------


def test_chunked_prefill_gives_the_logits_of_one_whole_prefill(model):
    ids = prompt(70, seed=1)
    logits = {}
    for chunk_size in (70, 16, 7):
        blocks = BlockManager(num_blocks=16, block_size=8)
        runner = ModelRunner(model, PagedKVCache(model.config, 16, 8))
        seq = make_seq("a", 70)
        seq.token_ids = list(ids)
        seq.block_table, _ = blocks.allocate(ids)
        for start in range(0, 70, chunk_size):
            out = runner.run(ScheduledBatch(prefills=[Chunk(seq, start, min(start + chunk_size, 70))]))
        logits[chunk_size] = out[id(seq)]
    whole = model(torch.tensor([ids]), last_only=True)[0, -1]
    for chunk_size, row in logits.items():
        torch.testing.assert_close(row, whole, rtol=1e-4, atol=1e-4, msg=f"chunks of {chunk_size} tokens")


@pytest.mark.parametrize("num_blocks, budget", [(256, 512), (14, 16)], ids=["roomy_pool", "pool_too_small_for_all"])
def test_greedy_engine_equals_the_simple_loop_and_preemption_loses_nothing(model, tokenizer, num_blocks, budget):
    """Mixed lengths, a shared prefix, chunked prompts; 14 blocks hold about a third of the requests at once."""
    shared = prompt(40, seed=2)
    prompts = [prompt(5, 3), prompt(90, 4), shared + prompt(6, 5), prompt(17, 6), shared + prompt(9, 7), prompt(2, 8)]
    lengths = [20, 12, 25, 30, 18, 24]
    eos = model.config.eos_token_ids
    engine = LLMEngine(model, tokenizer, eos, num_blocks=num_blocks, block_size=8, max_num_batched_tokens=budget)
    requests = {str(i): (p, SamplingParams(temperature=0, max_tokens=n)) for i, (p, n) in enumerate(zip(prompts, lengths))}
    got = run_engine(engine, requests)
    for request_id, (ids, params) in requests.items():
        assert got[request_id] == alone(model, ids, params.max_tokens, eos), f"request {request_id} differs from alone"
    assert engine.blocks.num_free == num_blocks, "every block is back in the pool"
    if num_blocks == 14:
        assert engine.num_preemptions > 0, "the small pool must have forced preemption"
        assert engine.blocks.hit_tokens > 0, "readmitted and later requests reuse cached blocks"


def test_a_later_request_reuses_the_cached_prefix_and_gets_the_same_tokens(model, tokenizer):
    eos = model.config.eos_token_ids
    engine = LLMEngine(model, tokenizer, eos, num_blocks=64, block_size=8)
    system = prompt(37, seed=16)
    first, second = system + prompt(5, seed=17), system + prompt(11, seed=18)
    params = SamplingParams(temperature=0, max_tokens=15)
    run_engine(engine, {"first": (first, params)})
    seq = engine.add_request("second", second, params)
    assert run_engine(engine, {})["second"] == alone(model, second, 15, eos)
    assert seq.num_cached_prompt == 32, "the 4 full blocks of the shared 37 tokens came from the cache"


def test_requests_added_between_steps_join_the_running_batch(model, tokenizer):
    eos = model.config.eos_token_ids
    engine = LLMEngine(model, tokenizer, eos, num_blocks=64, block_size=8)
    first, second = prompt(12, seed=9), prompt(7, seed=10)
    engine.add_request("first", first, SamplingParams(temperature=0, max_tokens=20))
    outputs = {"first": [], "second": []}
    for step in range(40):
        if step == 5:
            engine.add_request("second", second, SamplingParams(temperature=0, max_tokens=10))
        for out in engine.step():
            outputs[out.request_id] += out.new_token_ids
    assert outputs == {"first": alone(model, first, 20, eos), "second": alone(model, second, 10, eos)}


def test_seeded_sampling_does_not_depend_on_the_batch(model, tokenizer):
    params = SamplingParams(temperature=0.9, top_k=40, top_p=0.9, max_tokens=15, seed=123, ignore_eos=True)
    ids = prompt(9, seed=11)

    def sampled(others):
        engine = LLMEngine(model, tokenizer, [], num_blocks=64, block_size=8)
        requests = {"me": (ids, params)}
        requests.update({f"o{i}": (prompt(5 + i, 20 + i), SamplingParams(temperature=1.0, max_tokens=15)) for i in range(others)})
        return run_engine(engine, requests)["me"]

    assert sampled(0) == sampled(3), "a seeded request draws from its own generator"


def test_a_batched_draw_gives_each_seeded_row_its_own_draw_and_follows_the_probabilities():
    """sampler.race draws every row at once (one host copy a step, not one a row): a seeded row still gets
    exactly the token it draws alone, and the draws follow the probabilities."""
    from qwen3_scratch.engine.sampler import race

    probs = torch.softmax(torch.randn(5, 300, generator=torch.Generator().manual_seed(0)) * 3, dim=-1)
    seeded = lambda seed: torch.Generator().manual_seed(seed)
    together = race(probs, [seeded(1), None, seeded(2), None, seeded(3)]).tolist()
    for row, seed in ((0, 1), (2, 2), (4, 3)):
        assert together[row] == race(probs[row : row + 1], [seeded(seed)]).item(), f"row {row} drew another token"
    certain = torch.zeros(3, 300)
    certain[0, 7], certain[1, 299], certain[2, 0] = 1, 1, 1
    assert race(certain, [None, seeded(5), None]).tolist() == [7, 299, 0], "a certain token is always drawn"
    torch.manual_seed(0)  # the unseeded rows draw from torch's generator
    two = torch.tensor([[0.25, 0.75]]).expand(4000, 2).contiguous()
    share = race(two, [None] * 4000).sum().item() / 4000
    assert 0.72 < share < 0.78, f"token 1 of p = (0.25, 0.75) drawn {share:.3f} of the time"


def test_stop_strings_cut_the_text_and_finish_with_stop(model, tokenizer):
    ids = tokenizer.encode("def greet(name")
    text = tokenizer.decode(alone(model, ids, 20), skip_special_tokens=True)
    stop = "e model"  # spans two tokens: "(name" then " model"
    assert stop in text, f"the tiny model's greedy text changed: {text!r}"
    engine = LLMEngine(model, tokenizer, [], num_blocks=64, block_size=8)
    engine.add_request("a", ids, SamplingParams(temperature=0, max_tokens=20, stop=[stop]))
    pieces, last = [], None
    while engine.has_unfinished():
        for last in engine.step():
            pieces.append(last.new_text)
    assert "".join(pieces) == text[: text.find(stop)], "the text ends right before the first stop string"
    assert last.finish_reason == "stop"


def test_impossible_requests_are_refused_before_they_run(model, tokenizer):
    engine = LLMEngine(model, tokenizer, [], num_blocks=4, block_size=8)
    with pytest.raises(GenerationError, match="context is"):
        engine.add_request("long", prompt(model.config.max_position_embeddings, 13), SamplingParams())
    with pytest.raises(GenerationError, match="KV blocks but the pool has 4"):
        engine.add_request("big", prompt(10, 14), SamplingParams(max_tokens=100))
    unbounded = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    assert len(run_engine(engine, {"fits": (prompt(10, 15), unbounded)})["fits"]) == 4 * 8 - 10, (
        "max_tokens=None generates until the sequence fills what the pool can hold"
    )
    with pytest.raises(GenerationError, match="max_tokens must be"):
        SamplingParams(max_tokens=0)
    with pytest.raises(GenerationError, match="top_p"):
        SamplingParams(top_p=1.5)


# -- offline API -----------------------------------------------------------------------------------


def test_llm_generate_and_chat_in_vllms_shape(checkpoint, model):
    llm = LLM(str(checkpoint), num_blocks=64, block_size=8)
    outputs = llm.generate(["Hello, my name is", "The weather"], SamplingParams(temperature=0, max_tokens=12))
    assert [o.prompt for o in outputs] == ["Hello, my name is", "The weather"]
    for out in outputs:
        completion = out.outputs[0]
        expected = alone(model, out.prompt_token_ids, 12, llm.eos_ids)
        assert completion.token_ids == expected
        assert completion.text == llm.tokenizer.decode(expected, skip_special_tokens=True)
        assert completion.finish_reason == ("stop" if expected[-1] in llm.eos_ids else "length")
    messages = [{"role": "user", "content": "Say <|im_end|> twice"}]
    (chat,) = llm.chat(messages, SamplingParams(temperature=0, max_tokens=16))
    assert chat.prompt_token_ids == llm.tokenizer.chat_ids(messages), "chat prompts come from chat_ids"
    assert chat.outputs[0].message["role"] == "assistant" and "content" in chat.outputs[0].message
    assert llm.engine.blocks.num_free == 64


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_llm_for_one_or_two_requests_at_a_time_runs_the_one_row_layout_with_the_simple_loops_tokens(checkpoint, dtype):
    """On a CPU, an engine of at most two rows a step (a person's own server) runs the CLI's one-row kernels
    (engine.llm.engine_layout: faster there, less memory): greedy tokens as the simple loop's over the same
    layout, prompt chunks and decode rows packed as ever; a wider engine keeps the batch layout."""
    from qwen3_scratch.kernels.cpu_decode import CPUDecoderLayer

    prompts = [[3, 17, 101, 5, 260, 42, 7], [9, 8, 7] * 9, [11, 12]]
    for max_num_seqs in (1, 2):
        llm = LLM(str(checkpoint), dtype=dtype, num_blocks=64, block_size=8, max_num_seqs=max_num_seqs,
                  max_num_batched_tokens=16)  # fmt: skip
        assert all(type(layer) is CPUDecoderLayer for layer in llm.model.model.layers), "not the one-row layout"
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
        for ids, out in zip(prompts, outputs, strict=True):
            assert out.outputs[0].token_ids == alone(llm.model, ids, 10), f"{dtype}, {max_num_seqs} at a time: {ids}"
    wide = LLM(str(checkpoint), dtype=dtype, num_blocks=64, block_size=8, max_num_seqs=3)
    assert not any(isinstance(layer, CPUDecoderLayer) for layer in wide.model.model.layers)


def test_an_int8_model_keeps_its_kv_pool_in_the_activations_dtype_and_matches_the_simple_loop(checkpoint, tokenizer):
    # An int8 lm_head's weight is int8; the pool must take the embedding's dtype, or every key is truncated.
    quantized = load_model(checkpoint, dtype="bfloat16", optimize="batch", quantize="int8")
    engine = LLMEngine(quantized, tokenizer, eos_ids=[], num_blocks=32, block_size=8)
    assert engine.cache.keys.dtype == torch.bfloat16, f"the KV pool is {engine.cache.keys.dtype}"
    requests = {f"r{i}": (prompt(9 + 5 * i, i), SamplingParams(temperature=0, max_tokens=12)) for i in range(3)}
    outputs = run_engine(engine, requests)
    for request_id, (ids, _) in requests.items():
        assert outputs[request_id] == alone(quantized, ids, 12), f"{request_id}: int8 engine differs from the simple loop"
