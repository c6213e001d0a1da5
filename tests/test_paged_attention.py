"""Decode attention read in place from the paged pool (engine/paged_attention.py) against the gather path.

The gather path (PagedView: copy each row's blocks out, then the model's own attention) is the reference.
The in-place kernel must give its outputs, and a decode batch through the runner its logits: fp32 within
1e-5 relative, bf16 the same greedy tokens. The rows are made awkward on purpose: ragged lengths, a last
block partly filled, a row that fills its blocks exactly, blocks shared by two rows (prefix caching), and
prompts prefilled in chunks. The kernel compiles once per dtype and head shape in a process (seconds), so
every test here uses the tiny checkpoint's heads.
"""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from checkpoints import greedy_alone, one_thread_for_tiny_shapes, random_ids
from make_tiny_checkpoint import make_tiny_checkpoint

from qwen3_scratch import load_model
from qwen3_scratch.engine import paged_attention
from qwen3_scratch.engine.block_manager import BlockManager
from qwen3_scratch.engine.engine import LLMEngine
from qwen3_scratch.engine.model_runner import ModelRunner
from qwen3_scratch.engine.paged_cache import PagedKVCache
from qwen3_scratch.engine.scheduler import Chunk, ScheduledBatch, Sequence
from qwen3_scratch.model.qwen3 import one_query_attention
from qwen3_scratch.sampling.params import SamplingParams


one_thread = pytest.fixture(scope="module", autouse=True)(one_thread_for_tiny_shapes)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("paged") / "tiny")


@pytest.fixture(scope="module")
def model(checkpoint):
    return load_model(checkpoint)


def scattered_tables(lengths, block_size, shared_blocks, num_blocks, seed):
    """(B, W) block tables for rows of `lengths` keys, blocks drawn at random from the pool; every row
    long enough starts with the same `shared_blocks` blocks (a cached prefix); short rows padded with 0."""
    width = max(-(-n // block_size) for n in lengths)
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    shared, rest = order[:shared_blocks], iter(order[shared_blocks:])
    tables = []
    for n in lengths:
        own = -(-n // block_size)
        row = shared[:own] if n > shared_blocks * block_size else []
        row += [next(rest) for _ in range(own - len(row))]
        tables.append(row + [0] * (width - own))
    return torch.tensor(tables)


# (block size, keys per row, blocks shared by the rows long enough): ragged rows, last blocks partly filled
# or exactly full, a lone row of one key, and rows whose first blocks are one cached prefix.
MIXES = {
    "ragged-shared": (4, [5, 8, 9, 1], 1),
    "one-row-one-key": (4, [1], 0),
    "whole-blocks": (8, [16, 8, 24], 0),
    "long-shared-prefix": (8, [37, 41, 33, 64, 40, 2], 4),
    "block-of-one": (1, [3, 7, 1], 2),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mix", MIXES.values(), ids=MIXES.keys())
def test_the_kernel_equals_attention_over_the_gathered_blocks(model, dtype, mix):
    c = model.config
    H, K, D = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    bs, lengths, shared = mix
    g = torch.Generator().manual_seed(len(lengths))
    num_blocks = sum(-(-n // bs) for n in lengths) + 3
    key_blocks, value_blocks = (torch.randn(K, num_blocks, bs, D, generator=g).to(dtype) for _ in range(2))
    tables = scattered_tables(lengths, bs, shared, num_blocks, seed=len(lengths))  # (B, W)
    B, W = tables.shape
    valid = torch.arange(W * bs)[None, :] < torch.tensor(lengths)[:, None]  # (B, S)
    q = torch.randn(B, H, 1, D, generator=g).to(dtype)
    got = paged_attention.attend_in_place(q, key_blocks, value_blocks, tables, valid.view(B, W, bs))
    # The gather path's keys: (K, B, W, bs, D) -> (B, K, S, D), then the model's own attention.
    keys, values = (blocks[:, tables].flatten(2, 3).transpose(0, 1) for blocks in (key_blocks, value_blocks))
    mask = valid[:, None, None, :]  # (B, 1, 1, S)
    if dtype == torch.float32:  # the model's fp32 decode attention: SDPA
        expected = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    else:  # its bf16 decode attention on a CPU: one_query_attention, rounded where eager rounds
        expected = one_query_attention(q, keys, values, mask)
        torch.testing.assert_close(got.float(), expected.float(), rtol=0.02, atol=0.02)


def prefilled(model, in_place: bool, sequences, block_size: int, chunk: int):
    """A runner whose pool holds every sequence's tokens but its newest, prefilled `chunk` tokens at a time."""
    runner = ModelRunner(model, PagedKVCache(model.config, 24, block_size, dtype=model.activation_dtype,
                                             in_place=in_place))  # fmt: skip
    for seq in sequences:
        for start in range(0, len(seq.token_ids) - 1, chunk):
            end = min(start + chunk, len(seq.token_ids) - 1)
            runner.run(ScheduledBatch(prefills=[Chunk(seq, start, end)]))
    return runner


def decode_batch(model, in_place: bool):
    """One decode step for rows of ragged lengths, a shared prefix, prefilled in chunks of 5: logits (B, V)."""
    blocks, bs = BlockManager(num_blocks=24, block_size=4), 4
    shared = random_ids(9, seed=1)
    prompts = [shared + random_ids(3, seed=2), random_ids(8, seed=3), shared + random_ids(6, seed=4), random_ids(2, seed=5)]
    sequences = []
    for i, ids in enumerate(prompts):  # lengths 12, 8, 15, 2: partial and whole last blocks
        seq = Sequence(str(i), ids, len(ids), SamplingParams(), 4, frozenset())
        seq.block_table, _ = blocks.allocate(ids)
        blocks.seal_full_blocks(seq.block_table, ids, len(ids) - 1)  # prefix caching: row 2 reuses row 0's
        sequences.append(seq)
    assert sequences[2].block_table[:2] == sequences[0].block_table[:2], "rows 0 and 2 share two blocks"
    runner = prefilled(model, in_place, sequences, bs, chunk=5)
    assert runner.cache.in_place == in_place
    logits = runner.run(ScheduledBatch(decodes=[Chunk(seq, len(seq.token_ids) - 1, len(seq.token_ids)) for seq in sequences]))
    return torch.stack([logits[id(seq)] for seq in sequences])  # (B, V)


def test_a_decode_batch_in_place_gives_the_gathers_logits_in_fp32(model):
    torch.testing.assert_close(decode_batch(model, True), decode_batch(model, False), rtol=1e-5, atol=1e-5)


def test_bf16_in_place_decode_gives_the_gathers_greedy_tokens(checkpoint):
    model = load_model(checkpoint, dtype="bfloat16", optimize="batch")  # serving's layout
    in_place, gathered = decode_batch(model, True), decode_batch(model, False)
    assert torch.equal(in_place.argmax(-1), gathered.argmax(-1))
    torch.testing.assert_close(in_place.float(), gathered.float(), rtol=0.05, atol=0.05)


def test_the_engine_attends_in_place_and_matches_the_simple_loop_in_bf16(checkpoint, monkeypatch):
    """Greedy tokens of the engine (decodes in place, chunked prompts, a shared prefix) equal the simple
    loop's run alone, which attends over its own contiguous cache; and decode batches did run in place."""
    model = load_model(checkpoint, dtype="bfloat16", optimize="batch")
    calls = []
    original = paged_attention.attend_in_place
    monkeypatch.setattr(paged_attention, "attend_in_place", lambda *a: calls.append(a[0].shape[0]) or original(*a))
    engine = LLMEngine(model, None, [], num_blocks=64, block_size=8, max_num_batched_tokens=16)
    shared = random_ids(20, seed=6)
    prompts = [shared + random_ids(5, seed=7), random_ids(11, seed=8), shared + random_ids(13, seed=9), random_ids(3, seed=10)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, params)
    outputs = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id] += out.new_token_ids
    assert engine.cache.in_place and max(calls) == len(prompts), "decode batches of all rows ran in place"
    for i, ids in enumerate(prompts):
        alone = greedy_alone(model, ids, 12)
        assert outputs[str(i)] == alone, f"request {i} differs from the simple loop"


def test_one_compile_serves_the_engines_strided_queries_and_sliced_tables(model):
    """The engine hands the kernel views: a decode row's query strides by the step's token count, and its tables
    are a slice of wider ones. After the one compile (contiguous inputs, as the pool's warm-up builds it), such
    views of any batch and width run without compiling again (dynamo guards strides; a recompile is seconds on
    a CPU, at a server's first decode steps)."""
    c = model.config
    H, K, D = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    g = torch.Generator().manual_seed(0)
    key_blocks, value_blocks = (torch.randn(K, 12, 4, D, generator=g) for _ in range(2))

    def call(B, W, N, full_width):
        step_q = torch.randn(1, H, N, D, generator=g)  # a packed step's queries: its B decode rows come first
        q = step_q[0].transpose(0, 1)[:B, :, None]  # (B, H, 1, D), strided as PackedView._decodes makes it
        tables = torch.randint(0, 12, (B, full_width), generator=g)[:, :W]
        valid = torch.ones(B, W, 4, dtype=torch.bool)
        got = paged_attention.attend_in_place(q, key_blocks, value_blocks, tables, valid)
        want = paged_attention.paged_decode_attention(q, key_blocks, value_blocks, tables, valid)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)

    call(2, 2, 2, 2)  # contiguous: compiles, or reuses this process's compile
    with torch.compiler.set_stance("fail_on_recompile"):
        for B, W, N, full_width in ((3, 2, 7, 5), (1, 3, 9, 3), (5, 1, 5, 4)):
            call(B, W, N, full_width)


def test_past_dynamos_recompile_limit_the_kernel_runs_its_maths_uncompiled(monkeypatch):
    """A process that has compiled the kernel for as many head shapes as dynamo allows gets the same maths
    eagerly, with a warning, instead of an engine step that fails (fullgraph raises at the limit)."""
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 1)
    paged_attention._warn_once.cache_clear()  # warned once a process: this test must see its own warning
    outputs = []
    with pytest.warns(UserWarning, match="recompile limit"):
        for D in (8, 24, 40):  # three head sizes: at least two past a limit of one
            q, kb, vb = torch.randn(2, 4, 1, D), torch.randn(2, 10, 4, D), torch.randn(2, 10, 4, D)
            tables, valid = torch.randint(0, 10, (2, 3)), torch.ones(2, 3, 4, dtype=torch.bool)
            got = paged_attention.attend_in_place(q, kb, vb, tables, valid)
            outputs.append((got, paged_attention.paged_decode_attention(q, kb, vb, tables, valid)))
    for got, want in outputs:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# A server's start (the imports its command makes, then the LLM with its pool), and then one request's steps.
SERVER_START = """
import sys, warnings
import qwen3_scratch.server.app, qwen3_scratch.server.process, qwen3_scratch.server.async_engine
from qwen3_scratch.engine import paged_attention
from qwen3_scratch.engine.llm import LLM
from qwen3_scratch.sampling.params import SamplingParams
heavy = ("torch._dynamo", "torch._inductor", "sympy")
llm = LLM(sys.argv[1], dtype=sys.argv[2])
print(sorted(name for name in heavy if name in sys.modules))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    llm.engine.add_request("0", [3, 17, 101, 5, 260, 42], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    while llm.engine.has_unfinished():
        llm.engine.step()
print(llm.engine.cache.in_place, paged_attention._compiled.cache_info().currsize, [str(w.message) for w in caught if "paged attention" in str(w.message)])
"""


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_server_start_builds_no_kernel_and_the_first_decode_step_runs_the_compiled_one(checkpoint, dtype):
    """Building the kernel (dynamo's trace, inductor) took ~5 s of every qwen3-serve start before /health
    answered; now the pool decides at its warm-up or first decode step. The start must import none of the
    compiler, and the steps must then run the compiled kernel, not the gather or the eager fallback."""
    done = subprocess.run([sys.executable, "-c", SERVER_START, str(checkpoint), dtype], capture_output=True,
                          text=True, env=os.environ)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    imported, used = done.stdout.strip().splitlines()[-2:]
    assert imported == "[]", f"the server's start imported {imported}"
    assert used == "True 1 []", f"after the steps: in place, kernels compiled, warnings = {used}"
