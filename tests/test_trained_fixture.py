"""The session's trained model (trained_fixture.py) trains on one thread beside the tests and on two once the session
waits for it: the switch, wherever a step takes it, must move no bit of the weights, or the model would depend on when
the wait began; and a wait signalled before the training has a handler for it must not end the training. A trained
checkpoint is stored with what its training read (trained_store.py) and taken again only while all of it is
unchanged."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import train_tiny
import trained_fixture
import trained_store

STEPS = 4


@pytest.fixture(scope="module")
def tokenizer():
    return train_tiny.build_tokenizer(seed=trained_fixture.SEED)


def fixture_weights(tokenizer, monkeypatch, switch_at: int | None) -> dict[str, torch.Tensor]:
    """STEPS of the fixture's recipe from its seed on one thread; from step switch_at on, the threads the signal's
    handler sets (called there, between two steps' ops, as Python calls it)."""
    config = train_tiny.config_for(dict(train_tiny.TARGET, num_hidden_layers=trained_fixture.LAYERS), tokenizer)
    model = train_tiny.new_model(config, trained_fixture.SEED)
    batch, taken = train_tiny.Packer.batch, []

    def batch_then_switch(self, size):  # called once a step, before its forward
        if len(taken) == switch_at:
            trained_fixture.on_wait(None, None)
        taken.append(size)
        return batch(self, size)

    monkeypatch.setattr(train_tiny.Packer, "batch", batch_then_switch)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train_tiny.train(model, tokenizer, STEPS, trained_fixture.SEED, "fixture", mix=trained_fixture.MIX)
        expected = 1 if switch_at is None else min(trained_fixture.WAITED_THREADS, os.cpu_count() or 1)
        assert torch.get_num_threads() == expected, "the handler did not set the threads"
    finally:
        torch.set_num_threads(threads)
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


@pytest.mark.skipif(not trained_fixture.switches_threads(), reason="the fixture trains on one thread on this CPU")
def test_the_fixtures_steps_give_the_same_weights_on_one_thread_and_after_switching_to_two(tokenizer, monkeypatch):
    one_thread = fixture_weights(tokenizer, monkeypatch, switch_at=None)
    switched = fixture_weights(tokenizer, monkeypatch, switch_at=2)
    moved = [name for name in one_thread if not torch.equal(one_thread[name], switched[name])]
    assert not moved, f"two threads from step 2 moved {len(moved)} tensors of the fixture, e.g. {moved[:3]}"


def test_a_wait_signalled_as_the_training_starts_does_not_kill_it(tmp_path):
    """`pytest tests/test_trained_tiny.py` waits for the model at once, so result() signals a training process that
    has no handler yet (Python is still starting). The signal must wait for the handler, not end the training."""
    training = trained_fixture.BackgroundTraining(tmp_path / "tiny-qwen3-trained", stored=False)
    try:
        training.process.send_signal(signal.SIGUSR1)  # what result() sends, microseconds after the start
        time.sleep(3)
        code = training.process.poll()
        assert code is None, f"the training ended at the signal (exit {code}): {training.log.read_text()[-500:]}"
    finally:
        training.stop()


@pytest.fixture
def stored(tmp_path, monkeypatch):
    """A fake checkpoint stored under the inputs of a training that read one file of a repository (a folder of the
    test's, so that the test can change it) and imported torch."""
    monkeypatch.setenv("QWEN3_SCRATCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(trained_store, "ROOT", tmp_path / "repository")
    source = tmp_path / "repository" / "recipe.py"
    source.parent.mkdir()
    source.write_text("STEPS = 1000\n")
    checkpoint = tmp_path / "trained"
    checkpoint.mkdir()
    (checkpoint / "model.safetensors").write_bytes(b"weights")
    (checkpoint / "config.json").write_text("{}")
    read = trained_store.inputs({str(source)}, checkpoint)
    assert "recipe.py" in read["files"] and "torch" in read["distributions"], read
    return source, trained_store.store(checkpoint, read)


def test_a_stored_checkpoint_is_taken_only_while_what_its_training_read_is_unchanged(stored, tmp_path):
    source, entry = stored
    found = trained_store.find()
    assert found == entry / "checkpoint" and (found / "model.safetensors").read_bytes() == b"weights"
    training = trained_fixture.BackgroundTraining(tmp_path / "tiny-qwen3-trained")
    assert training.process is None and (training.result() / "model.safetensors").read_bytes() == b"weights"

    source.write_text("STEPS = 600\n")  # the recipe changed: train again
    assert trained_store.find() is None
    source.write_text("STEPS = 1000\n")
    assert trained_store.find() == entry / "checkpoint"


def test_another_torch_another_cpu_or_a_changed_checkpoint_is_never_taken(stored, monkeypatch):
    _, entry = stored
    record = json.loads((entry / "inputs.json").read_text())
    for change in ({"distributions": {**record["distributions"], "torch": "0.0.1"}},
                   {"machine": {**record["machine"], "cpu": "model name : another CPU"}}):  # fmt: skip
        (entry / "inputs.json").write_text(json.dumps({**record, **change}))
        assert trained_store.find() is None, f"taken with {change}"
    (entry / "inputs.json").write_text(json.dumps(record))
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # steers oneDNN's kernels, so their rounding
    assert trained_store.find() is None
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    assert trained_store.find() is not None

    (entry / "checkpoint" / "model.safetensors").write_bytes(b"weightz")  # changed after it was stored
    assert trained_store.find() is None and not entry.exists(), "a changed checkpoint must be deleted, not read"


def test_the_store_is_skipped_when_asked_to_train(stored, tmp_path, monkeypatch):
    monkeypatch.setenv("QWEN3_SCRATCH_TRAIN_FIXTURE", "1")
    training = trained_fixture.BackgroundTraining(tmp_path / "tiny-qwen3-trained")
    try:
        assert training.process is not None, "QWEN3_SCRATCH_TRAIN_FIXTURE=1 should train"
    finally:
        training.stop()


def test_a_training_records_the_recipe_the_model_code_the_corpus_and_the_libraries_it_read(tmp_path):
    """What the fixture's training process reads, recorded as it runs there: its recipe's files, the model's code it
    imports, the chat template and standard-library sources the corpus reads, the libraries' versions."""
    script = """
import json, sys, pathlib
sys.path[:0] = [sys.argv[1] + "/tests", sys.argv[1] + "/scripts/tiny"]
import trained_store
opened = trained_store.record_opens()
import train_tiny, tiny_corpus
train_tiny.CHAT_TEMPLATE_FILE.read_text()
next(tiny_corpus.text_pieces())
print(json.dumps(trained_store.inputs(opened, pathlib.Path(sys.argv[2]))))
"""
    done = subprocess.run([sys.executable, "-c", script, str(trained_store.ROOT), str(tmp_path)],
                          check=False, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    read = json.loads(done.stdout)
    files = {f for f in read["files"] if not Path(f).is_absolute()}  # the repository's, by their paths there
    wanted = {"tests/trained_store.py", "scripts/tiny/train_tiny.py", "scripts/tiny/tiny_corpus.py",
              "scripts/tiny/tiny_tasks.py", "scripts/checkpoints/qwen3_chat_template.jinja",
              "qwen3_scratch/model/qwen3.py", "qwen3_scratch/text/tokenizer.py"}  # fmt: skip
    assert wanted <= files, f"not recorded: {wanted - files}"
    assert any(Path(f).is_relative_to(trained_store.STDLIB) for f in read["files"]), "the corpus's sources"
    assert not any("site-packages" in f or ".egg-info" in f for f in read["files"]), "installs go by their versions"
    assert {"torch", "tokenizers", "safetensors"} <= read["distributions"].keys(), read["distributions"]
