"""What a benchmark ran on, for its report: the CPU (model and the flags torch's kernels care about),
cores, torch and transformers versions, the GPU if any, and the bandwidth measured in the same run.

Every speed figure this project reports names the CPU it was taken on (machines differ from session to
session: an Intel Xeon with AMX one time, an AMD EPYC without it the next)."""

import os
from pathlib import Path

import torch

# The CPU features that decide which kernels torch, oneDNN and inductor can use here.
KERNEL_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "avx512_fp16", "amx_bf16", "amx_int8", "amx_tile")


def cpu_info() -> tuple[str, list[str]]:
    """(the CPU's model name, the KERNEL_FLAGS it has), from /proc/cpuinfo ("?" and [] elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "?", []
    model = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return model, [flag for flag in KERNEL_FLAGS if flag in flags]


def machine(device: str, bandwidth: float) -> dict:
    import transformers

    cpu, flags = cpu_info()
    info = {"cpu": cpu, "cpu_flags": flags, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "transformers": transformers.__version__}  # fmt: skip
    if torch.device(device).type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    info["bandwidth_gb_s"] = round(bandwidth / 1e9, 1)  # generation.stats.measure_bandwidth: (read + write) / time
    return info
