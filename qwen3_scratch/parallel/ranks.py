"""How a process joins a tensor-parallel run: the rendezvous, the two process groups, its own device.

Every rank calls `init_groups` (rank 0 in group.py, the others in worker.py, or each process under
torchrun). The compute group carries the model's collectives with a timeout on each; the control group
carries rank 0's step descriptions and waits as long as rank 0 idles (group.py says why).
"""

import os
from datetime import timedelta

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 120.0  # a collective that waits longer means a rank hung; loading a shard is not one
CONTROL_TIMEOUT = timedelta(days=365)  # workers idle between steps: only a death should end that wait
LOAD_TIMEOUT = timedelta(hours=2)  # ranks wait for each other to finish loading: a 235B shard is minutes of disk


def init_groups(rank: int, world: int, init_method: str, device_type: str, timeout_s: float):
    """Join the groups (every rank calls this); returns (control group, loaded group).

    The loaded group holds one all-reduce after each load (`loaded`), so that no rank sends a step to a
    rank still reading its shard, with a timeout as long as a load may take.

    init_method: "tcp://127.0.0.1:PORT" for spawned workers, "env://" under torchrun (MASTER_ADDR, MASTER_PORT)."""
    backend = "nccl" if device_type == "cuda" else "gloo"
    timeout = timedelta(seconds=timeout_s)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world, timeout=timeout)
    # Each rank's timeout is its own: rank 0's sends give up like any collective, a worker's wait does not.
    control = dist.new_group(backend="gloo", timeout=timeout if rank == 0 else CONTROL_TIMEOUT)
    return control, dist.new_group(backend="gloo", timeout=LOAD_TIMEOUT)


def loaded(group) -> None:
    """Every rank has its shard (or one died loading, and this raises in the others)."""
    dist.all_reduce(torch.zeros(1), group=group)


def rank_device(device: str, local_rank: int) -> torch.device:
    """Each rank's own device: cuda:local_rank (its GPU on its machine) on GPUs, the CPU otherwise."""
    return torch.device(f"cuda:{local_rank}") if device.startswith("cuda") else torch.device("cpu")


def torchrun_ranks() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) when torchrun started this process, else None."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or "RANK" not in os.environ:
        return None
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))
