"""The session's trained model (trained_fixture.py) trains on one thread beside the tests and on two once the session
waits for it: the switch, wherever a step takes it, must move no bit of the weights, or the model would depend on when
the wait began; and a wait signalled before the training has a handler for it must not end the training."""

import os
import signal
import time

import pytest
import torch
import train_tiny
import trained_fixture

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
    training = trained_fixture.BackgroundTraining(tmp_path / "tiny-qwen3-trained")
    try:
        training.process.send_signal(signal.SIGUSR1)  # what result() sends, microseconds after the start
        time.sleep(3)
        code = training.process.poll()
        assert code is None, f"the training ended at the signal (exit {code}): {training.log.read_text()[-500:]}"
    finally:
        training.stop()
