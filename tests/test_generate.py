"""The generation loops: full recompute, KV cache and transformers agree, alone and batched."""

import pytest
import torch
from checkpoints import assert_logits_match, build_checkpoint, load_reference

from qwen3_scratch import GenerationError, load_model
from qwen3_scratch.generation.loops import CachedLoop, PaddedBatch, RecomputeLoop, generate_tokens
from qwen3_scratch.sampling.logits import LogitsFilter

GREEDY = LogitsFilter(temperature=0.0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("gen"), max_shard_size="40KB")


@pytest.fixture(scope="module")
def model(checkpoint):
    return load_model(checkpoint)


@pytest.fixture(scope="module")
def reference(checkpoint):
    return load_reference(checkpoint)


def prompt(length, seed):
    return torch.randint(3, 512, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(model, prompts, n, **kwargs):
    """All yielded steps as a (B, steps) list of lists."""
    steps = [t.tolist() for t in generate_tokens(model, prompts, n, **kwargs)]
    return [list(row) for row in zip(*steps)]


def transformers_greedy(reference, ids, n):
    out = reference.generate(
        torch.tensor([ids]), max_new_tokens=n, do_sample=False, output_logits=True,
        return_dict_in_generate=True, pad_token_id=0, eos_token_id=None,
    )  # fmt: skip
    return out.sequences[0, len(ids) :].tolist(), torch.cat(out.logits)  # tokens, (n, V) logits


@pytest.mark.parametrize("use_cache", [True, False], ids=["kv_cache", "recompute"])
def test_greedy_tokens_equal_transformers_generate(model, reference, use_cache):
    ids = prompt(17, seed=1)
    ours = run(model, [ids], 40, sampling=GREEDY, use_cache=use_cache)[0]
    theirs, _ = transformers_greedy(reference, ids, 40)
    assert ours == theirs, f"first difference at step {next(i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b)}"


def test_logits_of_both_loops_match_transformers_at_every_step(model, reference):
    ids = prompt(11, seed=2)
    tokens, their_logits = transformers_greedy(reference, ids, 24)
    batch = PaddedBatch.left_pad([ids], 0, "cpu")
    for loop in (CachedLoop(model, batch, 24), RecomputeLoop(model, batch)):
        logits = [loop.start()]
        for t in tokens[:-1]:
            logits.append(loop.step(torch.tensor([t])))
        assert_logits_match(torch.cat(logits), their_logits, f"{type(loop).__name__} over {len(tokens)} steps")


@pytest.mark.parametrize("use_cache", [True, False], ids=["kv_cache", "recompute"])
def test_batched_greedy_equals_each_prompt_alone(model, use_cache):
    prompts = [prompt(5, seed=3), prompt(23, seed=4), prompt(12, seed=5)]
    batched = run(model, prompts, 20, sampling=GREEDY, use_cache=use_cache)
    for i, p in enumerate(prompts):
        alone = run(model, [p], 20, sampling=GREEDY, use_cache=use_cache)[0]
        assert batched[i] == alone, f"prompt {i} (length {len(p)}) changed when batched with others"


def test_each_row_stops_at_its_own_eos(model):
    prompts = [prompt(6, seed=6), prompt(9, seed=7)]
    free = run(model, prompts, 12, sampling=GREEDY)
    eos = free[0][3]  # pretend row 0's 4th token is EOS
    stops = [row.index(eos) + 1 if eos in row else len(row) for row in free]
    expected = [row[:stop] + [-1] * (max(stops) - stop) for row, stop in zip(free, stops)]
    assert run(model, prompts, 12, sampling=GREEDY, eos_ids=[eos]) == expected, (
        "each row keeps its tokens up to and including its EOS, then yields -1 while others go on"
    )


def test_loop_ends_when_every_row_has_finished(model):
    ids = prompt(6, seed=8)
    free = run(model, [ids], 10, sampling=GREEDY)[0]
    stopped = run(model, [ids], 10, sampling=GREEDY, eos_ids=[free[2]])[0]
    assert stopped == free[: free.index(free[2]) + 1]
    assert run(model, [ids], 10, sampling=GREEDY, eos_ids=[free[2]], ignore_eos=True)[0] == free


def test_generation_stops_at_the_context_length(model):
    context = model.config.max_position_embeddings
    ids = prompt(context - 5, seed=9)
    assert len(run(model, [ids], 100, sampling=GREEDY)[0]) == 5


def test_prompt_longer_than_the_context_is_refused(model):
    ids = prompt(model.config.max_position_embeddings, seed=10)
    with pytest.raises(GenerationError, match="prompt is .* tokens but the model's context is"):
        next(generate_tokens(model, [ids], 4))


def test_sampled_generation_is_reproducible_with_a_seed(model):
    ids = prompt(8, seed=11)
    params = LogitsFilter(temperature=1.0, top_k=50)

    def draw(seed):
        return run(model, [ids], 15, sampling=params, generator=torch.Generator().manual_seed(seed))[0]

    assert draw(1) == draw(1)
    assert draw(1) != draw(2)


def test_compiled_decode_matches_eager(model):
    """torch.compile of the decode step (CUDA graphs on a GPU) must not change the tokens, also when a
    second generation reuses the compiled step's cache, still holding the first one's keys and values."""
    for seed, length in [(12, 7), (14, 19), (15, 3)]:
        ids = prompt(length, seed=seed)
        compiled = run(model, [ids], 6, sampling=GREEDY, compile=True)[0]
        assert compiled == run(model, [ids], 6, sampling=GREEDY)[0], f"prompt of {length} tokens"


def test_graph_runner_gives_the_eager_loops_tokens(model):
    """The CUDA-graph path (static buffers, inputs copied in, one runner per batch size), with the CPU's
    eager replay standing in for the graph: the eager loop's greedy tokens in fp32, alone and left-padded,
    and again when a later generation replays the runner made for an earlier one."""
    for prompts in ([prompt(7, seed=20)], [prompt(5, seed=21), prompt(13, seed=22)], [prompt(9, seed=23)]):
        graphed = run(model, prompts, 12, sampling=GREEDY, cuda_graphs=True)
        assert graphed == run(model, prompts, 12, sampling=GREEDY), f"batch of {len(prompts)}"


def test_graph_is_captured_once_per_batch_size_and_again_for_new_rope_tables(checkpoint):
    """A capture costs a GPU sync and seconds: it must happen once per batch size, not per generation; but
    a graph reads the RoPE table at the address it was captured with, so a longer table needs a new one."""
    from qwen3_scratch.generation import cuda_graph

    model = load_model(checkpoint)
    captures = []

    def counting(step):
        captures.append(step)
        return cuda_graph.run_eagerly(step)

    def generation(prompts, n):
        loop = CachedLoop(model, PaddedBatch.left_pad(prompts, 0, "cpu"), n, cuda_graphs=True)
        cuda_graph.graphed_decode(model, loop.cache, counting)  # the runner the loop will find
        loop.start()
        return loop.step(torch.zeros(len(prompts), dtype=torch.long))

    generation([prompt(4, seed=24)], 8)
    generation([prompt(6, seed=25)], 8)
    assert len(captures) == 1, "a second generation of the same batch size must replay the first capture"
    generation([prompt(4, seed=26), prompt(5, seed=27)], 8)
    assert len(captures) == 2, "a new batch size needs its own capture"
    model.build_rope_tables(length=model.rope_cos.shape[0] * 2)  # what reserve_positions does for a long prompt
    generation([prompt(4, seed=28)], 8)
    assert len(captures) == 3, "a graph over a freed RoPE table would read garbage: capture again"


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.cuda
@needs_cuda
def test_cuda_bf16_cache_recompute_and_compiled_agree(checkpoint):
    """On a GPU in bf16: the cached, recomputed and CUDA-graph-compiled loops give the same greedy tokens."""
    model = load_model(checkpoint, device="cuda", dtype="bfloat16")
    ids = prompt(21, seed=13)
    cached = run(model, [ids], 32, sampling=GREEDY)[0]
    assert cached == run(model, [ids], 32, sampling=GREEDY, use_cache=False)[0]
    assert cached == run(model, [ids], 32, sampling=GREEDY, compile=True)[0]


@pytest.mark.cuda
@needs_cuda
def test_cuda_decode_steps_never_wait_for_the_gpu(checkpoint):
    """After prefill, a decode step (cache write, attention, sampling) queues work without a host sync."""
    model = load_model(checkpoint, device="cuda", dtype="bfloat16")
    params = LogitsFilter(temperature=0.8, top_k=20, top_p=0.9)
    steps = generate_tokens(model, [prompt(9, seed=16)], 16, params, ignore_eos=True,
                            generator=torch.Generator("cuda").manual_seed(0))  # fmt: skip
    tokens = [next(steps)]  # prefill may sync (the prompt is copied to the GPU)
    torch.cuda.set_sync_debug_mode("error")
    try:
        tokens += list(steps)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(tokens) == 16


@pytest.mark.cuda
@needs_cuda
def test_cuda_graphs_by_default_give_the_eager_loops_tokens(checkpoint):
    """On a GPU the default loop replays CUDA graphs; --no-cuda-graphs runs it op by op: same tokens (fp32),
    also for a batch of two and for a second generation replaying the first one's graph."""
    model = load_model(checkpoint, device="cuda", dtype="float32")
    for prompts in ([prompt(11, seed=30)], [prompt(11, seed=31)], [prompt(5, seed=32), prompt(17, seed=33)]):
        eager = run(model, prompts, 24, sampling=GREEDY, cuda_graphs=False)
        assert run(model, prompts, 24, sampling=GREEDY) == eager, f"batch of {len(prompts)}"
