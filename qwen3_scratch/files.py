"""Reading the small files of a checkpoint (config.json, the index, tokenizer and generation configs,
the chat template), which come from the Hub and are untrusted.

Whatever is in them, reading ends in the file's contents or in one Qwen3Error line naming the file
and what is wrong: a directory where the file belongs, a file too large to be what it claims, bytes
that are not UTF-8, JSON that is invalid or nested deeply enough to exhaust Python's recursion.
"""

import json
import os
from pathlib import Path

from qwen3_scratch.errors import CheckpointError, printable

# The largest legitimate one is a tokenizer_config.json with a long template (~10 KB) or a large
# model's index (~100 KB); anything near this bound is not what its name says.
MAX_SMALL_FILE_BYTES = 64 * 1024 * 1024
REDOWNLOAD = "download the checkpoint again"
CACHE_ENV = "QWEN3_SCRATCH_CACHE"  # the folder of what is built once per machine (default ~/.cache/qwen3-scratch)


def cache_home() -> Path:
    """Where what a start builds once is kept for the next: stored CPU kernels (kernels/aot.py), tokenizer tables
    (text/bpe.py)."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "qwen3-scratch")


def read_bytes(path, error=CheckpointError, hint: str = REDOWNLOAD) -> bytes:
    """The file's bytes, at most MAX_SMALL_FILE_BYTES; `error` (a Qwen3Error class) with `hint` appended otherwise."""
    path = Path(path)
    where = printable(path)
    if path.is_dir():
        raise error(f"{where} is a directory, not a file; remove it and {hint}")
    try:
        if path.stat().st_size > MAX_SMALL_FILE_BYTES:
            raise error(f"{where} is {path.stat().st_size:,} bytes, too large to be this file; {hint}")
        return path.read_bytes()
    except OSError as e:
        raise error(f"{where}: cannot read ({e.strerror}); check the path and permissions") from e


def read_text(path, error=CheckpointError, hint: str = REDOWNLOAD) -> str:
    """The file's text, strictly UTF-8; `error` (a Qwen3Error class) with `hint` appended otherwise."""
    return decode_text(read_bytes(path, error, hint), path, error, hint)


def decode_text(data: bytes, path, error=CheckpointError, hint: str = REDOWNLOAD) -> str:
    """The bytes read from `path` as text, strictly UTF-8; `error` naming the file and the first bad byte otherwise."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        where = printable(Path(path))
        raise error(f"{where} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); {hint}") from e


def read_json(path, error=CheckpointError, hint: str = REDOWNLOAD) -> dict:
    """The JSON object in the file (a dict); `error` naming the file if it is anything else."""
    path = Path(path)
    text = read_text(path, error, hint)
    try:
        value = json.loads(text)
    except RecursionError as e:  # the C parser recurses once per nesting level
        raise error(f"{printable(path)}: JSON nested too deeply to be this file; {hint}") from e
    except ValueError as e:  # JSONDecodeError, or an integer literal of thousands of digits
        raise error(f"{printable(path)}: not valid JSON ({printable(e)}); {hint}") from e
    if not isinstance(value, dict):
        raise error(f"{printable(path)}: expected a JSON object, found {type(value).__name__}; {hint}")
    return value
