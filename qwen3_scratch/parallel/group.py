"""The ranks of a tensor-parallel run: rank 0 is this process, ranks 1..N-1 are spawned workers.

Two process groups over the same ranks (torch.distributed, no home-made transport):
  - compute: the model's collectives (layers.py), gloo on a CPU and NCCL on GPUs, with a timeout on every
    collective (`timeout_s`): a rank that hangs ends the run in bounded time instead of freezing it;
  - control: rank 0 broadcasts one step description per forward (worker.py), always gloo, with no
    practical timeout, because a worker waits there for as long as rank 0 has nothing to run (a server
    with no requests). A rank that *dies* breaks both groups at once: its sockets close, and the
    collective waiting on it raises in the others.

On a failure rank 0 names the rank and how it ended (`describe_failure`), marks the group broken (its
ranks can no longer be kept in step), ends the workers, and raises ParallelError: the CLIs print that
one line and exit 2. Workers end when rank 0 tells them, or when rank 0 dies (their broadcast raises).

Several machines: start the same processes with `torchrun` instead (README "Tensor parallelism"); the
groups are the same, only the rendezvous differs (MASTER_ADDR/MASTER_PORT from the environment).
"""

import atexit
import os
import socket
import sys
from multiprocessing import resource_tracker

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .plan import FLAG, ParallelError
from .ranks import DEFAULT_TIMEOUT_S, init_groups, torchrun_ranks
from .worker import worker_main

_GROUP: "ParallelGroup | None" = None


def start_quiet_resource_tracker() -> None:
    """Start multiprocessing's resource tracker without its warning about a killed worker's semaphores.

    A worker that is killed cannot release what it registered; the tracker releases it, then warns in
    three lines of its own, which would follow the run's one-line error. The filter applies to the
    tracker process alone (it takes its -W options from ours when it starts)."""
    saved = list(sys.warnoptions)
    sys.warnoptions.append("ignore:resource_tracker:UserWarning")
    try:
        resource_tracker.ensure_running()
    finally:
        sys.warnoptions[:] = saved


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ParallelGroup:
    """Rank 0's handle on the run: the worker processes, the control group, and whether it still works."""

    def __init__(self, world: int, device: str, timeout_s: float = DEFAULT_TIMEOUT_S, launched: bool = False):
        """launched: torchrun started the other ranks (on this machine or others); else spawn them here."""
        self.world, self.device, self.timeout_s = world, device, timeout_s
        self.broken: str | None = None  # why the group cannot be used any more
        self.workers, init_method = [], "env://"
        if not launched:
            threads = max(1, (os.cpu_count() or 1) // world)
            torch.set_num_threads(threads)  # rank 0 too: N ranks share the machine's cores
            start_quiet_resource_tracker()
            init_method, context = f"tcp://127.0.0.1:{free_port()}", mp.get_context("spawn")
            self.workers = [context.Process(target=worker_main, name=f"qwen3-tp-rank{rank}",
                                            args=(rank, world, init_method, device, timeout_s, threads))
                            for rank in range(1, world)]  # fmt: skip
            for process in self.workers:
                process.start()
        try:
            device_type = "cuda" if device.startswith("cuda") else "cpu"
            self.control, self.loading = init_groups(0, world, init_method, device_type, timeout_s)
        except Exception as error:
            self.fail(error, "starting")
        atexit.register(self.close)

    def send(self, message) -> None:
        """Broadcast one message (a step, a load, stop) to every worker."""
        self.check()
        try:
            dist.broadcast_object_list([message], src=0, group=self.control)
        except Exception as error:
            self.fail(error, "sending a step")

    def check(self) -> None:
        if self.broken:
            raise ParallelError(self.broken)
        if any(process.exitcode is not None for process in self.workers):
            self.fail(None, "between steps")

    def fail(self, error: BaseException | None, doing: str):
        """Mark the group broken, end the workers, raise one line naming what happened."""
        self.broken = f"tensor parallelism stopped while {doing}: {describe_failure(self.workers, error, self.timeout_s)}"
        self.close()
        raise ParallelError(self.broken) from error

    def close(self) -> None:
        """Stop the workers (politely while the group works, else at once) and leave the groups."""
        if not self.broken and all(p.exitcode is None for p in self.workers) and dist.is_initialized():
            try:
                dist.broadcast_object_list([("stop",)], src=0, group=self.control)
            except Exception:
                pass
        for process in self.workers:
            process.join(timeout=5 if not self.broken else 0.5)
            if process.exitcode is None:
                process.kill()
                process.join(timeout=5)
        self.broken = self.broken or "the tensor-parallel group was closed"
        if dist.is_initialized():
            dist.destroy_process_group()
        global _GROUP
        if _GROUP is self:
            _GROUP = None


def describe_failure(workers, error: BaseException | None, timeout_s: float) -> str:
    """One line: which rank ended and how, else a timeout, else the collective's own error."""
    for process in workers:
        process.join(timeout=0.5)  # a rank that is dying has a moment to be seen as dead
    dead = [(rank, p.exitcode) for rank, p in enumerate(workers, start=1) if p.exitcode is not None]
    if dead:
        rank, code = dead[0]
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        return f"rank {rank} {how}; the run cannot go on"
    text = " ".join(str(error).split())[:300] if error else "unknown"
    if "timeout" in text.lower() or "timed out" in text.lower():
        return f"a rank did not answer within {timeout_s:g} s (hung?); the run cannot go on ({text})"
    return f"a collective failed ({type(error).__name__}: {text})"


def get_group(world: int, device: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> ParallelGroup:
    """The process's one tensor-parallel group of `world` ranks, started on first use.

    Under torchrun every process runs the same command; the ones with RANK > 0 become workers here, at
    the point where rank 0 loads the model, and exit when rank 0 stops."""
    global _GROUP
    launched = torchrun_ranks()
    if launched is not None:
        rank, started, local_rank = launched
        if started != world:
            raise ParallelError(f"{FLAG} {world}, but torchrun started {started} processes; make them equal")
        if rank > 0:
            worker_main(rank, world, "env://", device, timeout_s, local_rank=local_rank)
            sys.exit(0)
    if _GROUP is not None and (_GROUP.world != world or _GROUP.device != device or _GROUP.broken):
        if not _GROUP.broken:
            raise ParallelError(f"this process already runs --tensor-parallel-size {_GROUP.world} on {_GROUP.device}; "
                                "one size per process")  # fmt: skip
        _GROUP = None
    if _GROUP is None:
        _GROUP = ParallelGroup(world, device, timeout_s, launched=launched is not None)
    return _GROUP
