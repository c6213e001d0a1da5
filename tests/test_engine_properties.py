"""Properties of the engine under random interleavings of add, abort and step (hypothesis).

Random requests (shared prefixes, greedy and seeded, some with a fault injected into their forward
or their sampling) are added, aborted and stepped in a random order over a small pool, so chunked
prefill, prefix hits, preemption and faults all meet. Whatever the order:
  - no request is lost: each one accepted ends exactly once, as finished, aborted or (only if a
    fault was injected into it) failed; nothing is left in the engine;
  - no block leaks: every block is back in the pool with no reference;
  - greedy requests get the simple loop's tokens, and seeded ones the tokens they get alone.
"""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from make_tiny_checkpoint import make_tiny_checkpoint

from qwen3_scratch import GenerationError, load_model
from qwen3_scratch.engine.engine import LLMEngine
from qwen3_scratch.engine.faults import MAX_FAILED_FORWARDS, EngineDeadError, Failed, ForwardHealth, each_alone
from qwen3_scratch.generation.loops import generate_tokens
from qwen3_scratch.sampling.logits import LogitsFilter
from qwen3_scratch.sampling.params import SamplingParams
from qwen3_scratch.text.tokenizer import Tokenizer

SHARED = [101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111, 112, 113]  # a common prefix, 3+ blocks of 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls on a shared 2-core machine
    checkpoint = make_tiny_checkpoint(tmp_path_factory.mktemp("properties") / "tiny")
    yield load_model(checkpoint), Tokenizer.from_checkpoint(checkpoint)
    torch.set_num_threads(threads)


@st.composite
def request_specs(draw):
    prefix = draw(st.sampled_from([[], SHARED[:8], SHARED]))
    prompt = prefix + draw(st.lists(st.integers(3, 1000), min_size=1, max_size=12))
    seeded = draw(st.booleans())
    params = SamplingParams(temperature=0.9 if seeded else 0.0, top_k=draw(st.sampled_from([0, 5])),
                            seed=draw(st.integers(0, 2**64 - 1)) if seeded else None,
                            max_tokens=draw(st.integers(4, 24)), ignore_eos=draw(st.booleans()))  # fmt: skip
    fault = draw(st.sampled_from([None, None, None, None, None, "forward", "sampling"]))
    return prompt, params, fault


OPS = st.one_of(st.tuples(st.just("add"), st.integers(0, 5)), st.tuples(st.just("abort"), st.integers(0, 5)),
                st.tuples(st.just("step"), st.integers(1, 4)))  # fmt: skip
POOLS = st.fixed_dictionaries({"num_blocks": st.integers(8, 12), "max_num_seqs": st.integers(2, 6),
                               "max_num_batched_tokens": st.integers(4, 24)})  # fmt: skip


def inject_faults(engine: LLMEngine, forward: set, sampling: set) -> None:
    """The test hook: the forward raises for requests in `forward`, appending a token for those in `sampling`."""
    run, append = engine.runner.run, engine.append

    def faulty_run(batch):
        if any(chunk.seq.request_id in forward for chunk in batch.decodes + batch.prefills):
            raise RuntimeError("injected forward fault")
        return run(batch)

    def faulty_append(seq, token):
        if seq.request_id in sampling:
            raise RuntimeError("injected sampling fault")
        return append(seq, token)

    engine.runner.run, engine.append = faulty_run, faulty_append


@given(specs=st.lists(request_specs(), min_size=2, max_size=6), ops=st.lists(OPS, max_size=30), pool=POOLS,
       overlapped=st.booleans())
@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])  # fmt: skip
def test_random_interleavings_lose_no_request_leak_no_block_and_match_the_simple_loop(tiny, specs, ops, pool,
                                                                                      overlapped):
    """overlapped: async scheduling (the GPU's default), tokens read back a step late; or each step's at once."""
    model, tokenizer = tiny
    eos = model.config.eos_token_ids
    engine = LLMEngine(model, tokenizer, eos, block_size=4, async_scheduling=overlapped, **pool)
    inject_faults(engine, {str(i) for i, s in enumerate(specs) if s[2] == "forward"},
                  {str(i) for i, s in enumerate(specs) if s[2] == "sampling"})  # fmt: skip
    tokens: dict[str, list[int]] = {}
    ends: dict[str, list[str]] = {}  # request id -> how it ended ("stop", "length", "error", "abort"), once
    for op, arg in ops + [("add", i) for i in range(len(specs))]:
        request_id = str(arg % len(specs)) if op != "step" else None
        if op == "add" and request_id not in tokens:
            prompt, params, _ = specs[int(request_id)]
            try:
                engine.add_request(request_id, prompt, params)
            except GenerationError:  # too big for this pool: refused up front, never half-added
                assert request_id not in engine.sequences
                continue
            tokens[request_id], ends[request_id] = [], []
        elif op == "abort" and request_id in engine.sequences:
            engine.abort(request_id)
            ends[request_id].append("abort")
        elif op == "step":
            for _ in range(arg):
                collect(engine.step(), tokens, ends)
    for _ in range(10_000):
        if not engine.has_unfinished():
            break
        collect(engine.step(), tokens, ends)

    assert not engine.has_unfinished() and not engine.sequences and not engine.texts, "nothing left in the engine"
    assert engine.in_flight is None, "no token left on the device"
    assert engine.blocks.num_free == engine.blocks.num_blocks, "every block is back in the pool"
    assert all(block.ref_count == 0 for block in engine.blocks.blocks)
    for request_id, ended in ends.items():
        prompt, params, fault = specs[int(request_id)]
        assert len(ended) == 1, f"request {request_id} ended {ended}: each request ends exactly once"
        assert ended[0] != "error" or fault is not None, f"request {request_id} failed without a fault of its own"
        if fault is not None or ended[0] in ("abort", "error"):
            continue
        expected = alone(model, tokenizer, tuple(prompt), params)
        assert tokens[request_id] == expected, f"request {request_id} ({params}) differs from its run alone"


def collect(outputs, tokens, ends) -> None:
    for out in outputs:
        assert not ends[out.request_id], f"output for {out.request_id} after it ended"
        tokens[out.request_id] += out.new_token_ids
        if out.finished:
            ends[out.request_id].append(out.finish_reason)
            assert (out.error is not None) == (out.finish_reason == "error")


def alone(model, tokenizer, prompt: tuple, params: SamplingParams) -> list[int]:
    """Greedy: the simple KV-cache loop. Seeded: the request alone in a roomy engine. (Cached: examples repeat.)"""
    key = (prompt, params.temperature, params.top_k, params.seed, params.max_tokens, params.ignore_eos)
    if key not in ALONE:
        ALONE[key] = run_alone(model, tokenizer, list(prompt), params)
    return ALONE[key]


ALONE: dict[tuple, list[int]] = {}


def run_alone(model, tokenizer, prompt: list[int], params: SamplingParams) -> list[int]:
    eos = [] if params.ignore_eos else model.config.eos_token_ids
    if params.greedy:
        return [int(t[0]) for t in generate_tokens(model, [prompt], params.max_tokens, LogitsFilter(0.0), eos)]
    engine = LLMEngine(model, tokenizer, model.config.eos_token_ids, num_blocks=32, block_size=4)
    engine.add_request("alone", prompt, params)
    out = []
    while engine.has_unfinished():
        out += [t for step in engine.step() for t in step.new_token_ids]
    return out


# -- the pieces ------------------------------------------------------------------------------------


def test_each_alone_pins_a_fault_on_the_item_that_raises_alone():
    def halve(items):
        if 3 in items:
            raise ValueError("3 is odd enough")
        return [i / 2 for i in items]

    assert each_alone(halve, [2, 4]) == [1.0, 2.0], "no fault: one call"
    results = each_alone(halve, [2, 3, 4])
    assert results[0] == 1.0 and results[2] == 2.0 and isinstance(results[1], Failed)
    assert str(results[1].error) == "3 is odd enough"


def test_the_engine_dies_only_after_many_forwards_fail_in_a_row():
    health = ForwardHealth()
    for _ in range(MAX_FAILED_FORWARDS - 1):
        health.record([Failed(RuntimeError("one bad request"))])
    health.record([Failed(RuntimeError("bad")), torch.zeros(1)])  # one forward worked: the model is fine
    assert health.failed_in_a_row == 0
    with pytest.raises(EngineDeadError, match="in a row"):
        for _ in range(MAX_FAILED_FORWARDS):
            health.record([Failed(RuntimeError("device lost"))])


def test_a_fault_in_scheduling_is_the_engines_and_propagates(tiny):
    model, tokenizer = tiny
    engine = LLMEngine(model, tokenizer, [], num_blocks=8, block_size=4)
    engine.add_request("a", [5, 6, 7], SamplingParams(temperature=0, max_tokens=2))

    def broken():
        raise RuntimeError("the block pool's books do not balance")

    engine.scheduler.schedule = broken
    with pytest.raises(RuntimeError, match="books"):
        engine.step()


@pytest.mark.parametrize("overlapped", [False, True], ids=["read_at_once", "overlapped"])
def test_the_offline_llm_raises_a_requests_fault_and_leaves_nothing_behind(tmp_path, overlapped):
    from qwen3_scratch.engine.llm import LLM

    llm = LLM(str(make_tiny_checkpoint(tmp_path / "tiny")), num_blocks=16, block_size=4, async_scheduling=overlapped)
    inject_faults(llm.engine, forward={"1"}, sampling=set())  # LLM numbers its requests 0, 1, ...
    with pytest.raises(RuntimeError, match="injected forward fault"):
        llm.generate([[5, 6, 7], [8, 9], [10]], SamplingParams(temperature=0, max_tokens=4))
    assert not llm.engine.has_unfinished() and llm.engine.blocks.num_free == 16, "the others were aborted, not kept"
    (out,) = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4))
    assert len(out.outputs[0].token_ids) == 4, "the next call runs as usual"
