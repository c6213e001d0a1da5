"""Overlapped engine steps (`async_scheduling`, the GPU's default): each step leaves its sampled tokens on the
device, the next step reads them there as its input ids, and the host reads them back one step later.

On a CPU nothing overlaps, but the bookkeeping is the same code: tokens fed from the device, a row queued for
a sequence that the late read back then finishes, preemption and abort with a token still on the device,
blocks sealed for the prefix cache once their last token is known. Every test compares the overlapped engine
with the engine that reads each step's tokens at once (and that one with the simple loop, in test_engine.py).
"""

import pytest
import torch
from test_engine import checkpoint, model, one_thread, prompt, tokenizer  # noqa: F401 (its fixtures, the tiny model)

from qwen3_scratch import load_model
from qwen3_scratch.engine.batch import pack
from qwen3_scratch.engine.engine import LLMEngine
from qwen3_scratch.engine.scheduler import Chunk, Sequence
from qwen3_scratch.sampling.params import SamplingParams


def run(engine, requests, late=None):
    """requests {id: (ids, params)} added up front (late: {step: requests} added before that step) ->
    ({id: tokens}, {id: text}, {id: finish reason}, steps)."""
    for request_id, (ids, params) in requests.items():
        engine.add_request(request_id, ids, params)
    tokens, text, reasons, steps = {}, {}, {}, 0
    while engine.has_unfinished() or (late and steps <= max(late)):
        for request_id, (ids, params) in (late or {}).get(steps, {}).items():
            engine.add_request(request_id, ids, params)
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            text[out.request_id] = text.get(out.request_id, "") + out.new_text
            if out.finished:
                reasons[out.request_id] = out.finish_reason
        steps += 1
    return tokens, text, reasons, steps


def both(model, tokenizer, requests, late=None, **engine_args):
    """The same requests through the engine reading each step's tokens at once, and through the overlapped one."""
    results = []
    for overlapped in (False, True):
        engine = LLMEngine(model, tokenizer, model.config.eos_token_ids, async_scheduling=overlapped, **engine_args)
        results.append((run(engine, dict(requests), late), engine))
    return results


def test_overlapped_steps_give_the_tokens_text_and_finish_of_steps_read_at_once(model, tokenizer):
    """Greedy fp32: mixed lengths, chunked prompts, a shared prefix, a request joining late, requests ended by
    a stop token (as EOS ends them: the overlapped engine has queued their next row before it knows) and by a
    stop string: outputs equal, token for token, and the same blocks sealed."""
    shared = prompt(40, seed=2)
    prompts = [prompt(5, 3), prompt(90, 4), shared + prompt(6, 5), prompt(17, 6), shared + prompt(9, 7), prompt(2, 8)]
    requests = {str(i): (p, SamplingParams(temperature=0, max_tokens=n)) for i, (p, n) in
                enumerate(zip(prompts, [20, 12, 1, 30, 18, 24]))}  # fmt: skip
    (plain, _, _, _), _ = both(model, tokenizer, requests, num_blocks=256, block_size=8)[0]
    for name, at in (("0", 4), ("3", 9), ("5", 0)):  # its own greedy token there, as a stop token
        requests[f"eos{name}"] = (requests[name][0], SamplingParams(temperature=0, max_tokens=30,
                                                                    stop_token_ids=[plain[name][at]]))  # fmt: skip
    stop = tokenizer.decode(plain["0"], skip_special_tokens=True)[5:9]
    requests["stopped"] = (prompts[0], SamplingParams(temperature=0, max_tokens=20, stop=[stop]))
    late = {3: {"late": (prompt(11, 9), SamplingParams(temperature=0, max_tokens=9))}}
    (at_once, engine), (overlapped, overlapped_engine) = both(model, tokenizer, requests, late, num_blocks=256,
                                                              block_size=8, max_num_batched_tokens=64)  # fmt: skip
    assert overlapped[:3] == at_once[:3]
    reasons = overlapped[2]
    assert reasons["stopped"] == "stop" and stop not in overlapped[1]["stopped"]
    assert [reasons[f"eos{n}"] for n in "035"] == ["stop"] * 3 and len(overlapped[0]["eos3"]) <= 10
    assert overlapped_engine.blocks.num_free == 256 and overlapped_engine.in_flight is None
    # the same blocks sealed: every full block of every request, prompt and output, is in the prefix cache
    assert set(overlapped_engine.blocks.cached) == set(engine.blocks.cached)


def test_an_overlapped_step_returns_the_step_befores_tokens_and_feeds_its_own_from_the_device(model, tokenizer):
    """The mechanism itself, so that a silent fall back to reading at once cannot pass the tests above."""
    engine = LLMEngine(model, tokenizer, [], num_blocks=64, block_size=8, async_scheduling=True)
    seq = engine.add_request("a", prompt(6, seed=1), SamplingParams(temperature=0, max_tokens=3))
    assert engine.step() == [], "the prompt's step returns nothing: its token is still on the device"
    assert seq.pending is not None and len(seq.token_ids) == 6 and seq.num_tokens == 7
    outs = engine.step()  # runs the token on the device, returns it
    assert [o.new_token_ids for o in outs] == [[seq.token_ids[6]]] and seq.pending is not None
    outs = engine.step()  # the third token is the last (max_tokens): no forward runs for it
    assert outs[0].new_token_ids == [seq.token_ids[7]] and not outs[0].finished
    forwards = engine.runner.num_forwards
    (last,) = engine.step()
    assert last.finished and last.finish_reason == "length" and engine.runner.num_forwards == forwards
    assert not engine.has_unfinished()
    # a stop token: the row queued after it is dropped, and nothing is left on the device
    stop = seq.token_ids[8]
    stopped = engine.add_request("b", prompt(6, seed=1), SamplingParams(temperature=0, stop_token_ids=[stop]))
    outs = [out for _ in range(5) for out in engine.step()]
    expected = seq.token_ids[6 : seq.token_ids.index(stop, 6) + 1]
    assert [t for o in outs for t in o.new_token_ids] == expected and outs[-1].finish_reason == "stop"
    assert not engine.has_unfinished() and engine.in_flight is None and stopped.pending is None


def test_a_pending_token_reaches_the_forward_from_the_device():
    """batch.pack: a row whose newest token is on the device gets it there, in its slot of input_ids."""
    seq = Sequence("a", [5, 6, 7], 2, SamplingParams(), 10, frozenset(), block_table=[3])
    seq.num_computed = 3
    seq.pending = (torch.tensor([41, 42, 43]), 1)
    other = Sequence("b", [8, 9], 2, SamplingParams(), 10, frozenset(), block_table=[4])
    other.num_computed = 1
    packed = pack([Chunk(seq, 3, 4), Chunk(other, 1, 2)], block_size=4, scratch_block=0, device="cpu")
    assert packed.input_ids.tolist() == [[42, 9]] and packed.positions.tolist() == [[3, 1]]
    assert packed.slots.tolist() == [3 * 4 + 3, 4 * 4 + 1] and packed.context_lens.tolist() == [4, 2]


def test_seeded_sampling_is_the_same_overlapped_and_preemption_and_abort_lose_nothing(model, tokenizer):
    """Seeded draws (their own generators) give the same tokens; a pool too small for all forces preemption
    with tokens on the device; an abort with a token on the device drops it and frees the blocks."""
    requests = {f"s{i}": (prompt(7 + 5 * i, 30 + i), SamplingParams(temperature=0.8, top_p=0.9, max_tokens=24,
                                                                     seed=100 + i, ignore_eos=True))
                for i in range(6)}  # fmt: skip
    (at_once, engine), (overlapped, overlapped_engine) = both(model, tokenizer, requests, num_blocks=14, block_size=8,
                                                              max_num_batched_tokens=16)  # fmt: skip
    assert overlapped[0] == at_once[0]
    assert overlapped_engine.num_preemptions > 0, "the small pool must have preempted"
    assert overlapped_engine.blocks.num_free == 14

    engine = LLMEngine(model, tokenizer, [], num_blocks=64, block_size=8, async_scheduling=True)
    kept = engine.add_request("kept", prompt(9, 1), SamplingParams(temperature=0, max_tokens=12))
    dropped = engine.add_request("dropped", prompt(9, 2), SamplingParams(temperature=0, max_tokens=12))
    for _ in range(3):
        engine.step()
    assert dropped.pending is not None
    engine.abort("dropped")
    rest = []
    while engine.has_unfinished():
        rest += engine.step()
    assert {o.request_id for o in rest} == {"kept"} and len(kept.output_ids) == 12
    assert engine.blocks.num_free == 64


def test_rows_that_need_their_token_on_the_host_read_each_step_at_once(model, tokenizer):
    """A grammar-free request with logprobs or penalties beside plain ones: those steps read back at once
    (the next mask or penalty needs the token), the others overlap; the outputs are the same."""
    requests = {
        "plain": (prompt(8, 1), SamplingParams(temperature=0, max_tokens=16)),
        "logprobs": (prompt(8, 2), SamplingParams(temperature=0, max_tokens=10, logprobs=2)),
        "penalty": (prompt(8, 3), SamplingParams(temperature=0, max_tokens=14, repetition_penalty=1.3)),
    }
    (at_once, _), (overlapped, _) = both(model, tokenizer, requests, num_blocks=64, block_size=8)
    assert overlapped[:3] == at_once[:3]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_overlapped_steps_give_the_tokens_of_steps_read_at_once(checkpoint, tokenizer):
    """On a GPU the copies go through pinned memory and the read back waits on an event: the flex route with
    graphs, fp32, greedy and seeded rows; the same outputs as steps read at once."""
    on_gpu = load_model(checkpoint, device="cuda", dtype=torch.float32, optimize="batch")
    requests = {f"g{i}": (prompt(5 + 7 * i, i), SamplingParams(temperature=0, max_tokens=20)) for i in range(5)}
    requests |= {f"s{i}": (prompt(9 + i, 50 + i), SamplingParams(temperature=0.7, max_tokens=16, seed=i, ignore_eos=True))
                 for i in range(3)}  # fmt: skip
    (at_once, _), (overlapped, engine) = both(on_gpu, tokenizer, requests, num_blocks=128, block_size=16)
    assert engine.async_scheduling and overlapped[:3] == at_once[:3]
    assert engine.runner.graphs is not None and engine.runner.graphs.replays > 0
