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
    monkeypatch.delenv("QWEN3_SCRATCH_TRAIN_FIXTURE", raising=False)  # a session told to train: not these tests
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
    try:
        assert training.process is None, "a stored checkpoint should be taken, not trained again"
        assert (training.result() / "model.safetensors").read_bytes() == b"weights"
    finally:
        training.stop()

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


def fake_training(tmp_path, body: str) -> subprocess.Popen:
    """A process standing for the controller's training: it notes a SIGUSR1 in `told`, then runs body."""
    script = f"""
import pathlib, signal, sys, time
here = pathlib.Path(sys.argv[1])
signal.signal(signal.SIGUSR1, lambda *_: (here / "told").touch())
print("ready", flush=True)
{body}
"""
    process = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "ready"
    return process


def handle(tmp_path, pid) -> str:
    return json.dumps({"out": str(tmp_path / "tiny-qwen3-trained"), "pid": pid})


def test_a_worker_waits_for_the_controllers_training_and_tells_it_so(tmp_path):
    process = fake_training(tmp_path, f"time.sleep(1); (here / {trained_fixture.DONE!r}).touch(); time.sleep(30)")
    try:
        out = trained_fixture.SharedTraining(handle(tmp_path, process.pid)).result()
        assert out == tmp_path / "tiny-qwen3-trained" and (tmp_path / trained_fixture.DONE).exists()
        assert (tmp_path / "told").exists(), "the waiting worker should let the training take the idle cores"
    finally:
        process.kill()
        process.wait()


def test_a_worker_is_told_when_the_controllers_training_failed_or_died(tmp_path):
    failed = fake_training(tmp_path, f"(here / {trained_fixture.FAILED!r}).write_text('RuntimeError: no disk')")
    with pytest.raises(RuntimeError, match="no disk"):
        trained_fixture.SharedTraining(handle(tmp_path, failed.pid)).result()
    (tmp_path / trained_fixture.FAILED).unlink()
    failed.wait()

    killed = fake_training(tmp_path, "time.sleep(30)")
    killed.kill()  # its parent has not waited for it yet: a zombie, ended
    with pytest.raises(RuntimeError, match="ended without a checkpoint"):
        trained_fixture.SharedTraining(handle(tmp_path, killed.pid)).result()
    killed.wait()


def test_under_xdist_the_controller_trains_once_and_hands_it_to_every_worker(tmp_path):
    """`pytest -n 2` with this suite's conftest: the workers find the controller's one training in their
    environment (each would otherwise start its own), a running trained_fixture.py process."""
    (tmp_path / "test_two.py").write_text("""
import json, os, pathlib, pytest

@pytest.mark.parametrize("n", range(8))
def test_handed(n):
    handle = json.loads(os.environ["QWEN3_SCRATCH_FIXTURE_TRAINING"])
    command = pathlib.Path(f"/proc/{handle['pid']}/cmdline").read_bytes().split(b"\\0")
    assert command[1].endswith(b"trained_fixture.py"), command
    (pathlib.Path(os.environ["SEEN"]) / f"{os.environ['PYTEST_XDIST_WORKER']}-{handle['pid']}").touch()
""")
    seen = tmp_path / "seen"
    seen.mkdir()
    # nothing stored (a cache of the test's own): the controller starts a training
    env = {**os.environ, "PYTHONPATH": str(trained_store.ROOT / "tests"), "SEEN": str(seen),
           "QWEN3_SCRATCH_CACHE": str(tmp_path / "cache")}  # fmt: skip
    env.pop(trained_fixture.SHARED, None)
    env.pop("PYTEST_ADDOPTS", None)  # the outer session's options (its plugins) are not the inner one's
    command = [sys.executable, "-m", "pytest", "-n", "2", "--dist", "load", "-p", "conftest", "-p", "no:cacheprovider",
               "-q", str(tmp_path / "test_two.py")]  # fmt: skip
    done = subprocess.run(command, cwd=tmp_path, env=env, check=False, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    workers = {name.split("-")[0] for name in os.listdir(seen)}
    trainings = {name.split("-")[1] for name in os.listdir(seen)}
    assert workers == {"gw0", "gw1"} and len(trainings) == 1, sorted(os.listdir(seen))
    (pid,) = trainings
    assert not trained_fixture.alive(int(pid)), "the controller should stop its training when the session ends"


def test_the_suites_conftest_loads_without_pytest_xdist():
    """The GPU machine has no pytest-xdist (gpu_check.py runs `pytest -o addopts= -m cuda` there): the conftest's
    xdist hook must be optional, or pytest refuses the conftest before running a test."""
    command = [sys.executable, "-m", "pytest", "-p", "no:xdist", "-o", "addopts=", "-p", "no:cacheprovider", "-q",
               f"{__file__}::test_a_stored_checkpoint_is_taken_only_while_what_its_training_read_is_unchanged"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    done = subprocess.run(command, cwd=trained_store.ROOT, env=env, check=False, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0 and "1 passed" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]
