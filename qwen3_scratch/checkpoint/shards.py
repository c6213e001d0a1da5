"""One weight file (a shard): opened and validated by the `safetensors` library, its damage explained.

The library is the reference reader of the format, and it refuses every malformed header:
overlapping, negative or gapped offsets, sizes that disagree with shapes, duplicate names whose
bytes differ, a file shorter or longer than its header says. We never parse the format to accept a
file; when the library refuses one, we read its first bytes only to say *why* in words a user can
act on (a git-LFS pointer, cut short, not a safetensors file at all).

A safetensors file is: 8 bytes (little-endian u64 N), N bytes of JSON header
{name: {"dtype", "shape", "data_offsets": [begin, end]}}, then the raw tensor bytes.
"""

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from qwen3_scratch.errors import CheckpointError, printable

SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
LFS_POINTER_PREFIX = b"version https://git-lfs"
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors library's own bound


@dataclass
class TensorEntry:
    file: Path
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    shard: object  # the library's open handle on `file` (a safe_open), which maps it once
    rows: tuple | None = None  # an index into the stored tensor `name` (one expert of a fused tensor), or all of it

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class DamagedFile(CheckpointError):
    """A weight file that is missing, cut short, or not a safetensors file at all."""

    def __init__(self, file: Path, problem: str):
        self.file, self.problem = file, problem  # problem reads after the name: "is truncated (...)"
        super().__init__(f"{printable(file)} {problem}; download it again")


def open_shard(file: Path):
    """The `safetensors` library's handle on one shard, after it has validated the whole header.

    Nothing of the tensor data is read. The Hub download uses this too, to find files worth fetching again.
    """
    if not file.is_file():
        raise DamagedFile(file, "is a directory, not a weight file" if file.is_dir() else "is missing")
    try:
        return safe_open(file, framework="pt")
    except SafetensorError as error:
        raise DamagedFile(file, _diagnose(file, str(error))) from error
    except OSError as e:
        raise CheckpointError(f"{printable(file)}: cannot read ({e.strerror}); check the path and permissions") from e


read_raw_header = open_shard  # the name hub.py imports


def _diagnose(file: Path, reason: str) -> str:
    """Why the library refused `file`, in words a user can act on. It has already refused: this only explains."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(len(LFS_POINTER_PREFIX))
        if head == LFS_POINTER_PREFIX:
            return "is a git-LFS pointer, not the weights (the repo was cloned without git-lfs)"
        if len(head) < 8:
            return "is empty" if size == 0 else "is too short to be a safetensors file"
        (header_len,) = struct.unpack("<Q", head[:8])
        if header_len > min(MAX_HEADER_BYTES, size - 8):
            return "is not a safetensors file (bad header length)"
        f.seek(8)
        last = _last_tensor_end(f.read(header_len))
    if last is not None and 8 + header_len + last[1] > size:
        return f"is truncated ({size} bytes, but tensor {printable(last[0])} ends at byte {8 + header_len + last[1]})"
    reason = reason.removeprefix("Error while deserializing header: ")
    return f"has a corrupt safetensors header ({printable(reason)})"


def _last_tensor_end(header: bytes) -> tuple[str, int] | None:
    """(name, end offset) of the tensor that ends last, if the header is readable enough to say."""
    try:
        entries = json.loads(header).items()
        ends = {name: int(info["data_offsets"][1]) for name, info in entries if name != "__metadata__"}
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, RecursionError):
        return None
    return max(ends.items(), key=lambda item: item[1], default=None)


def read_safetensors_header(file: Path) -> dict[str, TensorEntry]:
    """Every tensor of one shard -> its dtype and shape, as the library read them; no data is read."""
    shard = open_shard(file)
    return {name: _entry(file, name, shard) for name in shard.keys()}


def _entry(file: Path, name: str, shard) -> TensorEntry:
    info = shard.get_slice(name)
    if info.get_dtype() not in SAFETENSORS_DTYPES:
        raise CheckpointError(
            f"{printable(file)}: tensor {printable(name)} has dtype {info.get_dtype()}; only BF16/F16/F32 weights "
            "are supported (quantized checkpoints are not)"
        )
    return TensorEntry(file, name, SAFETENSORS_DTYPES[info.get_dtype()], tuple(info.get_shape()), shard)
