"""Stored CPU kernels (kernels/aot.py): a start that loads AOTInductor packages generates the tokens of a
start that built its kernels with inductor and of the eager layers; it imports no compiler; the cache key
follows shapes, dtype, torch's version and the code; a corrupt, foreign or unverified entry is never used.
The packages are built once per dtype for the tiny checkpoint (~1-2 min: AOTInductor compiles each)."""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from make_tiny_checkpoint import make_tiny_checkpoint
from server_process import start_server, stop_server

from qwen3_scratch.checkpoint.weights import load_model
from qwen3_scratch.engine import paged_attention
from qwen3_scratch.generation.loops import generate_tokens
from qwen3_scratch.kernels import aot, aot_build, gpu_decode, int4, matvec, one_row_attention
from qwen3_scratch.sampling.logits import LogitsFilter

GREEDY = LogitsFilter(temperature=0.0)
PROMPT = [[3, 17, 101, 5, 260, 42, 7, 311]]


@pytest.fixture
def kernel_cache(tmp_path, monkeypatch):
    """A cache of this test's own, turned on, and no kernel kept from an earlier load in this process."""
    monkeypatch.setenv("QWEN3_SCRATCH_AOT", "1")
    monkeypatch.setenv(aot.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(matvec, "_KERNELS", {})
    monkeypatch.setattr(aot, "PENDING", {})
    caches = (matvec.unavailable_reason,  # each process's first checks
              paged_attention.stored_kernel, gpu_decode._stored, one_row_attention.kernel)  # fmt: skip
    for cached in caches:
        cached.cache_clear()
    yield tmp_path / "cache"
    for cached in caches:
        cached.cache_clear()


def greedy_tokens(path, dtype, optimize="decode") -> list[int]:
    model = load_model(path, dtype=dtype, optimize=optimize)
    return torch.cat(list(generate_tokens(model, PROMPT, 12, GREEDY, ignore_eos=True))).tolist()


def build_pending() -> list[bool]:
    return [aot_build.build(key) for key in list(aot.PENDING.values())]


# bf16 only: each dtype really builds its packages (~70 s here), and the mechanism is the same for fp32;
# every package is checked bit for bit against inductor's kernel when it is built, whatever its dtype.
@pytest.mark.parametrize("dtype", ["bfloat16"])
def test_packaged_kernels_give_the_tokens_of_inductor_kernels_and_of_the_eager_layers(tmp_path, kernel_cache, dtype):
    path = make_tiny_checkpoint(tmp_path / "tiny-qwen3")  # bf16, with a tokenizer: the CLI runs on it below
    built_now = greedy_tokens(path, dtype)  # no cache yet: inductor builds every kernel
    assert aot.PENDING, "the kernels inductor built were not handed over for packaging"
    functions = {key["function"].split(":")[1] for key in aot.PENDING.values()}
    assert "one_row_attention" in functions, f"decode attention was not handed over for packaging: {functions}"
    verified = build_pending()
    assert all(verified), f"packages differ from inductor's kernels: {verified}"
    matvec._KERNELS.clear()
    aot.PENDING.clear()
    loaded = greedy_tokens(path, dtype)  # a later start: every kernel from its package
    assert all(isinstance(k, aot.PackagedKernel) for k in matvec._KERNELS.values()), "a kernel was not loaded from the cache"
    assert not aot.PENDING, "a later start found kernels missing from the cache"
    eager = greedy_tokens(path, dtype, optimize=None)
    assert loaded == built_now, f"{dtype}: tokens from stored kernels {loaded} differ from freshly built ones {built_now}"
    assert loaded == eager, f"{dtype}: tokens from stored kernels {loaded} differ from the eager layers' {eager}"
    # and a new `qwen3-generate` loads them without importing the compiler, transformers or the Hub's client
    heavy = ("torch._inductor", "torch._dynamo", "sympy", "transformers", "huggingface_hub.utils")
    code = ("import sys; from qwen3_scratch.cli.generate import main; "
            f"main(['--model', {str(path)!r}, '--prompt', 'Hi', '--max-new-tokens', '4', '--dtype', {dtype!r}]); "
            f"print(sorted(n for n in {heavy!r} if n in sys.modules))")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ, check=True)
    imported = done.stdout.strip().splitlines()[-1]
    assert imported == "[]", f"a start with stored kernels imported {imported}"
    assert "building" not in done.stderr, f"a start with every kernel stored built some again: {done.stderr}"


@pytest.mark.parametrize("words", [False, True], ids=["torch-packing", "words"])
def test_int4_halves_package_bit_for_bit_and_give_the_same_tokens(tmp_path, kernel_cache, monkeypatch, words):
    """int4 layers' two kernels, over either layout of the nibbles (int4.py; words: an AVX2 CPU's, chosen here on
    any CPU): torch's int4 kernel called from inside the graph on packed bytes, or the words loop traced into it.
    Their packages (checked on random codes) match inductor's kernels, and a later start decodes the same tokens."""
    monkeypatch.setenv("QWEN3_SCRATCH_INT4_LAYOUT", "words" if words else "torch")
    suffix = "_int4_words" if words else "_int4"
    path = make_tiny_checkpoint(tmp_path / "tiny-qwen3")
    model = load_model(path, dtype="bfloat16", optimize="decode", quantize="int4")
    built_now = torch.cat(list(generate_tokens(model, PROMPT, 8, GREEDY, ignore_eos=True))).tolist()
    halves = [key for key in aot.PENDING.values() if key["function"].endswith(suffix)]
    assert len(halves) == 2, f"an int4 layer did not run as its two kernels: {list(aot.PENDING)}"
    codes = ("float32", 3) if words else ("uint8", 2)  # (dtype, dimensions) of the codes as the halves read them
    assert any((dtype, len(shape)) == codes for key in halves for shape, dtype in key["args"]), "no codes argument"
    assert all(aot_build.build(key) for key in halves), "an int4 half's package differs from inductor's kernel"
    matvec._KERNELS.clear()
    model = load_model(path, dtype="bfloat16", optimize="decode", quantize="int4")
    loaded = torch.cat(list(generate_tokens(model, PROMPT, 8, GREEDY, ignore_eos=True))).tolist()
    kernels = model.model.layers[0]._kernels.values()
    assert sum(isinstance(k, aot.PackagedKernel) for k in kernels) == 2, "the int4 halves were not loaded from the cache"
    assert loaded == built_now, f"int4 tokens from stored kernels {loaded} differ from freshly built ones {built_now}"


# The engine's greedy tokens for two prompts, in a process of its own or here; and which compiler modules it imported.
ENGINE_RUN = """import sys
from qwen3_scratch.engine.llm import LLM
from qwen3_scratch.sampling.params import SamplingParams
llm = LLM(sys.argv[1], dtype="bfloat16")
outputs = llm.generate([[3, 17, 101, 5, 260, 42], [7, 311, 9] * 7], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
print([list(out.outputs[0].token_ids) for out in outputs])
print(sorted(name for name in ("torch._inductor", "torch._dynamo", "sympy") if name in sys.modules))
"""


def test_a_servers_paged_attention_and_glue_are_packaged_after_it_exits_for_any_batch_and_later_engines_compile_nothing(
        tmp_path, kernel_cache):  # fmt: skip
    """The engine's in-place paged attention (engine/paged_attention.py) is compiled at a server's first decode
    step, and its layers' glue (kernels/gpu_decode.py: four kernels a layer) at its load; when `qwen3-serve` exits
    it hands them to the background builder, which packages each once for every batch, token count, table width,
    pool and block size. The attention's package equals the compiled kernel bit for bit on inputs strided as the
    engine hands them, and a later engine decodes the compiled kernels' tokens with the packages, without importing
    the compiler (a server's first request: the ~5 s of dynamo, inductor and the build; its load: ~7 s more)."""
    path = make_tiny_checkpoint(tmp_path / "tiny-qwen3")
    run = [sys.executable, "-c", ENGINE_RUN, str(path)]
    first = subprocess.run(run, capture_output=True, text=True, env=os.environ, check=True).stdout.splitlines()
    assert "torch._dynamo" in first[1], "the first engine run should have compiled its paged attention and glue"

    process, url = start_server(str(path), ["--dtype", "bfloat16"])
    body = {"model": str(path), "prompt": "hello", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    assert httpx.post(f"{url}/v1/completions", json=body, timeout=120).status_code == 200
    code, _ = stop_server(process, grace=30)
    assert code == 0 and "building" in process.stderr.read(), "the server did not hand its kernels to the builder"
    config = load_model(path).config
    H, K, D = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    assert paged_attention.stored_kernel(torch.bfloat16, torch.bfloat16, torch.long, torch.bool, H, D, K) is None
    (key,) = [key for key in aot.PENDING.values() if key["function"].endswith(":paged_decode_attention")]
    assert [shape for shape, _ in key["args"]][3:] == [["B", "W"], ["B", "W", "bs"]], "rows and widths must be any"
    wanted = {"paged_decode_attention", "heads", "norm", "residual_norm", "swiglu"}  # the glue: gpu_decode.py's

    def stored() -> dict[str, bool]:  # function -> verified, of the entries the builder has written so far
        entries = [json.loads(e.read_text()) for e in (aot.cache_root() / aot.machine_key()).glob("*/" + aot.ENTRY)]
        return {entry["key"]["function"].split(":")[1]: entry["verified"] for entry in entries}

    # The builder runs at nice 19 on what the session leaves (~50 s alone); under `pytest -n` another worker's tests
    # can hold the cores for minutes (it missed a 300 s deadline so, beside the fixture's training)
    deadline = time.monotonic() + 900
    while not wanted <= stored().keys() and time.monotonic() < deadline:  # the builder: after the exit, niced
        time.sleep(0.5)
    assert stored() == dict.fromkeys(wanted, True), f"packages built and verified: {stored()}"
    paged_attention.stored_kernel.cache_clear()

    g = torch.Generator().manual_seed(1)
    blocks = [torch.randn(K, 40, 8, D, generator=g).bfloat16() for _ in range(2)]
    for B, W, N in ((1, 1, 1), (5, 4, 9), (12, 3, 30)):  # rows, table width, the step's tokens
        q = torch.randn(1, H, N, D, generator=g).bfloat16()[0].transpose(0, 1)[:B, :, None]  # strided, as the engine's
        tables = torch.randint(0, 40, (B, W + 2), generator=g)[:, :W]  # a slice of wider tables
        valid = torch.rand(B, W, 8, generator=g) < 0.7
        valid[:, 0, 0] = True
        got = paged_attention.attend_in_place(q, *blocks, tables, valid)
        assert paged_attention.stored_kernel(torch.bfloat16, torch.bfloat16, torch.long, torch.bool, H, D, K) is not None
        want = paged_attention.attend_compiled(q.contiguous(), *blocks, tables.contiguous(), valid)
        assert torch.equal(got, want), f"rows {B}, width {W}: the package's bits differ from the compiled kernel's"

    later = subprocess.run(run, capture_output=True, text=True, env=os.environ, check=True).stdout.splitlines()
    assert later[0] == first[0], f"tokens with the stored package {later[0]} differ from the compiled kernel's {first[0]}"
    assert later[1] == "[]", f"an engine with its paged attention and glue stored imported {later[1]}"


def test_the_engines_fp32_glue_is_stored_and_equals_its_compiled_kernel_for_any_token_count_one_included(kernel_cache):
    """A CPU engine's glue (gpu_decode.py) is compiled for any token count, then packaged for any: the two must be
    one kernel. dynamo's kernel for a single token summed an fp32 norm's row in another order than the package,
    the builder refused it, and every fp32 server start compiled its glue again; compiled with sizes oblivious
    (aot.compile_for_any_size), it is stored, and its bits are the compiled kernel's at every count."""
    g = torch.Generator().manual_seed(0)
    weight, eps = torch.randn(1024, generator=g), {"eps": 1e-6}
    assert gpu_decode.stored_any_length_kernel(gpu_decode.norm, [torch.zeros(1, 1, 1024), weight], eps) is None
    (key,) = [key for key in aot.PENDING.values() if key["function"].endswith(":norm")]
    assert aot_build.build_dynamic(key), "the fp32 norm's package is not the compiled kernel, bit for bit"
    gpu_decode._stored.cache_clear()
    stored = gpu_decode.stored_any_length_kernel(gpu_decode.norm, [torch.zeros(1, 1, 1024), weight], eps)
    compiled = gpu_decode.any_size_kernel(gpu_decode.norm)
    for B, T in ((1, 1), (1, 7), (4, 1), (3, 16)):
        x = torch.randn(B, T, 1024, generator=g)
        assert torch.equal(stored(x, weight), compiled(x, weight, **eps)), f"{B} rows of {T} tokens"


def test_the_cache_key_follows_shapes_dtype_torch_version_and_the_machine(kernel_cache, monkeypatch):
    x, w = torch.empty(1, 64), torch.empty(32, 64, dtype=torch.bfloat16)
    folder = aot.entry_folder(aot.kernel_key(matvec.matvec, [x, w], {}))
    others = [aot.kernel_key(matvec.matvec, [x, torch.empty(48, 64, dtype=torch.bfloat16)], {}),
              aot.kernel_key(matvec.matvec, [x, w.float()], {}),
              aot.kernel_key(matvec.matvec_int8, [x, w], {})]  # fmt: skip
    assert len({folder, *map(aot.entry_folder, others)}) == 4, "different shapes, dtypes or functions share an entry"
    monkeypatch.setattr(torch, "__version__", torch.__version__ + "+other")
    aot.machine_key.cache_clear()
    try:
        moved = aot.entry_folder(aot.kernel_key(matvec.matvec, [x, w], {}))
    finally:
        aot.machine_key.cache_clear()
    assert moved.parent != folder.parent and moved != folder, "another torch version would reuse this one's kernels"


@pytest.fixture(scope="module")
def packaged_matvec(tmp_path_factory) -> Path:
    """A small kernel's entry, packaged once for the tests below (~10 s: AOTInductor compiles it)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(aot.CACHE_ENV, str(tmp_path_factory.mktemp("packaged") / "cache"))
        key = aot.kernel_key(matvec.matvec, [torch.empty(1, 64), torch.empty(32, 64)], {})
        assert aot_build.build(key), "the package differs from inductor's kernel"
        return aot.entry_folder(key)


@pytest.fixture
def one_stored_kernel(kernel_cache, packaged_matvec):
    """That kernel's entry in the test's cache, loaded once: (arguments, its entry folder)."""
    args = [torch.randn(1, 64), torch.randn(32, 64)]
    folder = aot.entry_folder(aot.kernel_key(matvec.matvec, args, {}))
    shutil.copytree(packaged_matvec, folder)
    assert isinstance(aot.load(matvec.matvec, args, {}), aot.PackagedKernel)
    return args, folder


def test_a_corrupt_package_is_deleted_not_loaded(one_stored_kernel):
    args, folder = one_stored_kernel
    package = folder / aot.PACKAGE
    data = bytearray(package.read_bytes())
    data[len(data) // 2] ^= 0xFF
    package.write_bytes(bytes(data))
    assert aot.load(matvec.matvec, args, {}) is None, "a package whose checksum is wrong was loaded"
    assert not folder.exists(), "the corrupt entry was kept, to be tried again at every start"
    assert not isinstance(matvec.kernel(matvec.matvec, *args), aot.PackagedKernel), "the kernel should come from inductor"


def test_a_foreign_or_unverified_entry_is_never_loaded(one_stored_kernel, tmp_path):
    args, folder = one_stored_kernel
    entry = json.loads((folder / aot.ENTRY).read_text())
    shutil.copytree(folder, tmp_path / "saved")
    (folder / aot.ENTRY).write_text(json.dumps({**entry, "key": {**entry["key"], "args": [[[1, 8], "float32"]]}}))
    assert aot.load(matvec.matvec, args, {}) is None and not folder.exists(), "an entry for another key was trusted"
    shutil.copytree(tmp_path / "saved", folder)
    (folder / aot.ENTRY).write_text(json.dumps({**entry, "verified": False}))
    assert aot.load(matvec.matvec, args, {}) is None, "a package that differed from inductor's kernel was loaded"
    assert folder.exists(), "an unverified entry is the decision to use inductor; it should stay"


def test_a_cache_that_cannot_be_written_hands_nothing_over_and_raises_nothing(kernel_cache, tmp_path, monkeypatch):
    """A command's exit (qwen3-serve's, after its last request) must not fail because the cache cannot be written:
    no builder, no traceback, and every later start compiles as before."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(aot.CACHE_ENV, str(blocker / "cache"))  # a folder below a file: mkdir fails
    aot.remember(paged_attention.paged_decode_attention, [torch.empty(0)], {})
    assert aot.PENDING
    assert aot_build.start_background_build() is False
    assert not aot.PENDING


BUILDER_PARENT = """import sys, torch
from qwen3_scratch.kernels import aot, aot_build, matvec
aot.remember(matvec.matvec, [torch.empty(1, 64), torch.empty(32, 64)], {})
assert aot_build.start_background_build()
print("started", flush=True)
sys.stdin.read()  # the builder waits for this process to exit
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/autogroup"), reason="Linux's autogroups only")
def test_the_background_builder_takes_the_lowest_share_of_the_cpu_in_its_own_session(kernel_cache):
    """The builder's session is an autogroup of its own, which Linux shares the CPU with as an equal of the user's
    session unless its own nice is lowered: it must be 19, as the builder's own nice is."""
    parent = subprocess.Popen([sys.executable, "-c", BUILDER_PARENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True, env=os.environ)  # fmt: skip
    builders = []
    try:
        assert parent.stdout.readline().strip() == "started"
        deadline, group = time.monotonic() + 30, ""
        while time.monotonic() < deadline and "nice 19" not in group:
            builders = [pid for pid in os.listdir("/proc") if pid.isdigit() and builds_into(pid, kernel_cache)]
            group = " ".join(read_proc(pid, "autogroup") for pid in builders)
            time.sleep(0.2)
        assert len(builders) == 1, f"one builder should run for the test's cache, found {builders}"
        (pid,) = builders
        assert "nice 19" in read_proc(pid, "autogroup"), f"the builder's autogroup: {read_proc(pid, 'autogroup')!r}"
        assert read_proc(pid, "stat").rsplit(")", 1)[1].split()[16] == "19", "the builder itself should run at nice 19"
        assert os.getsid(int(pid)) != os.getsid(0), "the builder should have a session of its own"
    finally:
        for pid in builders:
            try:
                os.kill(int(pid), 9)
            except ProcessLookupError:
                pass
        parent.kill()
        parent.wait()


def builds_into(pid: str, cache) -> bool:
    """True if process pid is a builder whose specs file lies in the cache folder `cache`."""
    command = read_proc(pid, "cmdline")
    return "aot_build" in command and str(cache) in command


def read_proc(pid: str, name: str) -> str:
    try:
        return Path(f"/proc/{pid}/{name}").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:  # gone, or not ours
        return ""


PICKED_ISA = """
import json, torch
from torch._inductor import config, cpu_vec_isa
with config.patch({"cpp.vec_isa_ok": %s}):
    isa = cpu_vec_isa.pick_vec_isa()
print(json.dumps([str(isa), isa.build_arch_flags()]))
"""


def test_kernels_compile_for_the_instruction_set_inductors_probes_would_pick():
    """aot.INDUCTOR_OPTIONS skips inductor's test builds of each instruction set (~7 s of a first start ever): the
    instruction set and compiler flags it then compiles for must be the ones the probes pick, or a first start's
    kernels and a package built by a probing process could differ."""
    if "TORCHINDUCTOR_VEC_ISA_OK" not in os.environ:  # a user's own setting is left alone (and the probes kept)
        assert aot.INDUCTOR_OPTIONS["cpp.vec_isa_ok"] is True
        assert matvec.inductor_options(matvec.matvec)["cpp.vec_isa_ok"] is True
        assert paged_attention.INDUCTOR_OPTIONS["cpp.vec_isa_ok"] is True
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_VEC_ISA_OK"}
    runs = {trusted: subprocess.Popen([sys.executable, "-c", PICKED_ISA % trusted], stdout=subprocess.PIPE, text=True,
                                      env=env) for trusted in ("True", "None")}  # None: inductor's default, a probe per instruction set
    picked = {trusted: json.loads(run.communicate(timeout=300)[0]) for trusted, run in runs.items()}
    assert picked["True"] == picked["None"], f"without probes inductor picks {picked['True']}, with them {picked['None']}"
