"""The test session's trained tiny Qwen3 (docs/tiny-model.md#the-test-fixture), trained in a process of its own.

Training takes ~4 minutes of a 2-core CPU, a third of the suite. Most other tests leave a core idle (one thread
for tiny matmuls, a server waiting on its client, a command starting), so the training starts with the session,
at the lowest CPU priority there is (SCHED_IDLE): it runs on the cycles nothing else wants, and the tests beside
it run as if it were not there. The tests that read the model run last (conftest.py), and wait for what is left.

It trains on one thread while tests run. Two threads at idle priority waited on each other: whenever a test took one
core, the thread left running spun at the next barrier, and a step took 2.2 s instead of 0.27. Once the session has
nothing left to run but the tests that read the model, it waits for it with both cores idle, and tells the training
so (SIGUSR1, kept if it comes before torch is imported): the steps left run on WAITED_THREADS threads, 1.9-2.3x the
steps a second alone on the AMD EPYC Zen 3. The thread count does not move a bit of the weights (one thread against
two: the same weights on the AMD EPYC Zen 4 over 40 steps, and on the Zen 3 over 40 steps switched from one thread
to two at step 20; tests/test_trained_fixture.py checks it wherever the suite runs), so when the session began to
wait does not change the model. A CPU with AMX (oneDNN's AMX kernels, whose split of a product between threads was
not compared) trains on one thread throughout.

A session whose training would read exactly what an earlier one on this machine read takes that one's checkpoint from
the store (tests/trained_store.py) instead of training again. Under pytest-xdist the controller process trains (or
takes the stored one) once, and each worker waits for it there (SharedTraining).

    python tests/trained_fixture.py OUT [--store]     # what the session runs: the fixture's checkpoint in OUT
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

import trained_store

# The fixture's recipe: the target's shapes (2 layers) and optimizers (Muon and AdamW) on a mix weighted to what
# the tests check: column addition, unit conversion (the easy family) and calculator episodes. 1,000 steps, not
# the 600 first tuned on the AMD EPYC: the digit tables form in a narrow band of steps, and another CPU's rounding
# moves the band (600 steps gave 90% of held-out sums on the EPYC, 37% on an Intel Xeon with AMX, 500 steps 10%
# on the EPYC). At 1,000 the Intel gets 83%: the skill is a few hundred steps past its onset on both, so the
# tests' bars do not depend on which CPU trained the model.
STEPS = 1000
LAYERS = 2
MIX = {"add": 0.8, "convert": 0.06, "tool": 0.08, "repeat": 0.03, "small_talk": 0.03}
SEED = 0
WAITED_THREADS = 2  # the threads of the steps left once the session waits (the thread counts compared bit for bit)

ROOT = Path(__file__).resolve().parents[1]


def train(out: Path) -> Path:
    """Train the fixture's model with scripts/tiny/train_tiny.py into out (a new folder), on one thread (this
    process's torch is left so); returns out."""
    sys.path.insert(0, str(ROOT / "scripts" / "tiny"))
    import torch
    import train_tiny

    torch.set_num_threads(1)
    if switches_threads():  # from here on the signal sets the threads; one that came before torch did, now
        signal.signal(signal.SIGUSR1, on_wait)
        if WAITED:
            on_wait(signal.SIGUSR1, None)

    tokenizer = train_tiny.build_tokenizer(seed=SEED)
    shapes = dict(train_tiny.TARGET, num_hidden_layers=LAYERS)
    return train_tiny.train_checkpoint(out, shapes, tokenizer, STEPS, seed=SEED, name="test", mix=MIX)


def lowest_priority() -> None:
    """This process, before it starts a thread: the idle scheduling class (its threads inherit it), else nice 19."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        os.nice(19)


class BackgroundTraining:
    """The fixture's checkpoint in out: copied from the store when it holds one whose inputs are unchanged (with
    `stored`), else `python tests/trained_fixture.py out` at idle priority, which stores what it trains; `result()`
    waits for it and returns out."""

    def __init__(self, out: Path, stored: bool = True):
        self.out, self.log = out, out.parent / "training.log"
        self.process = None
        found = trained_store.find() if stored and trained_store.enabled() else None
        if found is not None:
            shutil.copytree(found, out)
            self.log.write_text(f"taken from the store: {found}\n")
            (out.parent / DONE).touch()
            return
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        # The child starts with SIGUSR1 blocked (a signal mask is inherited), until it has its handler: a wait
        # signalled in its first ~50 ms (`pytest tests/test_trained_tiny.py` waits at once) stays pending, where
        # the signal's default action killed it (exit -10).
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
        try:
            with open(self.log, "wb") as log:
                self.process = subprocess.Popen([sys.executable, __file__, str(out), *(["--store"] if stored else [])],
                                                stdout=log,
                                                stderr=subprocess.STDOUT, env=env)  # fmt: skip
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)

    def result(self) -> Path:
        if self.process is None:
            return self.out
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGUSR1)  # the session waits: the training may take the idle cores
        code = self.process.wait()
        if code != 0:
            tail = self.log.read_text(errors="replace").strip().splitlines()[-15:]
            raise RuntimeError(f"training the fixture's model failed (exit {code}):\n" + "\n".join(tail))
        return self.out

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def handle(self) -> str:
        """What a pytest-xdist worker needs to wait for this training (SharedTraining), as one string."""
        return json.dumps({"out": str(self.out), "pid": None if self.process is None else self.process.pid})


DONE, FAILED = "trained", "failed"  # written beside out by the training process as it ends (and on a store's hit)
SHARED = "QWEN3_SCRATCH_FIXTURE_TRAINING"  # the controller's BackgroundTraining.handle(), for its workers


class SharedTraining:
    """Another process's BackgroundTraining, waited for: under pytest-xdist the controller trains once (conftest.py)
    and every worker that reads the model waits here. The training process says how it ended in a file beside
    out (DONE, or FAILED with its error); one that ends without either (killed) is an error too."""

    def __init__(self, handle: str):
        fields = json.loads(handle)
        self.out, self.pid = Path(fields["out"]), fields["pid"]
        self.log = self.out.parent / "training.log"

    def result(self) -> Path:
        if self.pid is not None and alive(self.pid):
            os.kill(self.pid, signal.SIGUSR1)  # a worker waits: the training may take the idle cores
        while not (self.out.parent / DONE).exists():
            failed = self.out.parent / FAILED
            if failed.exists():
                raise RuntimeError(f"training the fixture's model failed:\n{failed.read_text(errors='replace')}")
            if self.pid is None or not alive(self.pid):
                if (self.out.parent / DONE).exists():
                    break
                raise RuntimeError(f"training the fixture's model ended without a checkpoint: see {self.log}")
            time.sleep(0.2)
        return self.out

    def stop(self) -> None:  # the controller, which started it, stops it
        pass


def alive(pid: int) -> bool:
    """Whether process pid runs (a zombie, ended and not yet waited for by its parent, does not)."""
    if Path("/proc/self/stat").exists():
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False
    try:  # no /proc: whether a signal can reach it
        os.kill(pid, 0)
    except OSError:
        return False
    return True


def switches_threads() -> bool:
    """Whether the steps left switch to WAITED_THREADS threads when the session waits: on a CPU without AMX, where
    the thread count was compared bit for bit (fp32 steps on AVX2, bf16 ones on AVX-512's bf16 instructions)."""
    try:
        return "amx_bf16" not in Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux: one thread, as before
        return False


WAITED = []  # a wait signalled before train() imported torch (remember_wait)


def remember_wait(signum, frame) -> None:
    WAITED.append(signum)


def on_wait(signum, frame) -> None:
    """The session waits for the model: the steps left run on WAITED_THREADS threads (Python runs this between two
    of the step's ops, whose results do not depend on the thread count)."""
    import torch  # imported by train() before it handles the signal

    torch.set_num_threads(min(WAITED_THREADS, os.cpu_count() or 1))


if __name__ == "__main__":
    signal.signal(signal.SIGUSR1, remember_wait)  # until train() has torch to set the threads of
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1})  # a wait signalled before now arrives here
    opened = trained_store.record_opens() if "--store" in sys.argv else None
    lowest_priority()  # before torch starts its thread pools
    out = Path(sys.argv[1])
    try:
        train(out)
        if opened is not None:
            trained_store.store(out, trained_store.inputs(opened, out))
    except BaseException:
        (out.parent / FAILED).write_text(traceback.format_exc()[-3000:])
        raise
    (out.parent / DONE).touch()
