"""How a process joins a tensor-parallel run: the rendezvous, the two process groups, its own device.

Every rank calls `init_groups` (rank 0 in group.py, the others in worker.py, or each process under
torchrun). The compute group carries the model's collectives with a timeout on each; the control group
carries rank 0's step descriptions and waits as long as rank 0 idles (group.py says why).
"""

from datetime import timedelta

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 120.0  # a collective that waits longer means a rank hung; loading a shard is not one
CONTROL_TIMEOUT = timedelta(days=365)  # workers idle between steps: only a death should end that wait


def init_groups(rank: int, world: int, address: str, port: int, device_type: str, timeout_s: float):
    """Join both groups (every rank calls this); returns the control group."""
    backend = "nccl" if device_type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://{address}:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))  # fmt: skip
    return dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)


def rank_device(device: str, rank: int) -> torch.device:
    """Each rank's own device: cuda:rank on GPUs, the CPU otherwise."""
    return torch.device(f"cuda:{rank}") if device.startswith("cuda") else torch.device("cpu")
