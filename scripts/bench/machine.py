"""What a benchmark ran on, and how it prints its tables: the one way every script in scripts/bench/ reports.

`machine(device, bandwidth)` is the record (the CPU's model and the flags torch's kernels care about, cores, RAM,
torch and transformers versions, the GPU if any, the bandwidth measured in the same run); `machine_line(info)`
prints it above the table; `Table` prints a Markdown table row by row, as each row is measured, in the form
docs/performance.md pastes.

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


def machine(device: str = "cpu", bandwidth: float | None = None) -> dict:
    import transformers

    cpu, flags = cpu_info()
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    info = {"cpu": cpu, "cpu_flags": flags, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "ram_gib": round(ram / 2**30, 1), "torch": torch.__version__, "transformers": transformers.__version__}  # fmt: skip
    if torch.device(device).type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    if bandwidth is not None:  # generation.stats.measure_bandwidth: (read + write) / time
        info["bandwidth_gb_s"] = round(bandwidth / 1e9, 1)
    return info


def machine_line(info: dict) -> str:
    """The line above every table: `machine: cpu Intel(R) Xeon(R) Processor, cpu_flags [...], cores 2, ...`."""
    return "machine: " + ", ".join(f"{key} {value}" for key, value in info.items())


class Table:
    """A Markdown table printed as it is measured: the header now, each row when `row` is called (flushed, so a
    long run shows its progress). The first `text_columns` columns are left-aligned, the rest are numbers."""

    def __init__(self, *columns: str, text_columns: int = 1):
        self.width = len(columns)
        print("| " + " | ".join(columns) + " |")
        print("|" + "---|" * text_columns + "---:|" * (self.width - text_columns), flush=True)

    def row(self, *cells) -> None:
        if len(cells) != self.width:
            raise ValueError(f"a row of {len(cells)} cells in a table of {self.width} columns")
        print("| " + " | ".join(str(cell) for cell in cells) + " |", flush=True)
