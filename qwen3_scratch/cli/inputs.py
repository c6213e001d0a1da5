"""What a user types at a command, bounded: prompts from flags, a file or stdin.

Prompts are untrusted input: a 100 MB paste, `--prompts-file /dev/zero`, bytes that are not UTF-8.
Everything here is bounded before it is read in full, so a bad input costs milliseconds and one
error line, never the process's memory. The limits:

- MAX_PROMPT_BYTES (4 MiB, text/limits.py) for one prompt;
- MAX_INPUT_BYTES (64 MiB) for all of stdin or a prompts file together;
- text must be UTF-8, strictly: the error names the source, the line and the byte offset. Guessing
  an encoding, or replacing bad bytes, would feed the model text the user never wrote.

This module imports nothing heavy (no torch): the CLIs read and check their input before loading.
"""

import fcntl
import os
import stat
import struct
import termios
from pathlib import Path

from qwen3_scratch.errors import InputError
from qwen3_scratch.text.limits import MAX_PROMPT_BYTES, check_prompt

MAX_INPUT_BYTES = 64 * 2**20


def read_prompts(prompt: list[str] | None = None, prompts_file=None, stdin=None) -> list[str]:
    """The prompts from --prompt (repeatable), then --prompts-file (one per non-blank line); stdin
    (one prompt, all of it) only when neither is given and stdin is not a terminal."""
    prompts = [check_prompt(text, "--prompt") for text in prompt or []]
    if prompts_file is not None:
        prompts += read_prompts_file(Path(prompts_file))
    if not prompts and stdin is not None and not stdin.isatty():
        prompts = [read_stdin(stdin)]
    if not prompts or not all(text.strip() for text in prompts):
        raise InputError("no prompt: pass --prompt TEXT, --prompts-file FILE, or pipe text on stdin")
    return prompts


def read_stdin(stdin) -> str:
    """All of stdin as one prompt, reading at most MAX_PROMPT_BYTES + 1 bytes to find out."""
    source = getattr(stdin, "buffer", stdin)  # a text stream without .buffer (tests) reads as str
    data = source.read(MAX_PROMPT_BYTES + 1)
    if len(data) > MAX_PROMPT_BYTES:
        raise InputError(f"stdin: more than {MAX_PROMPT_BYTES:,} bytes, the limit for one prompt; "
                         "shorten it, or pass several prompts with --prompts-file")  # fmt: skip
    return decode_utf8(data, "stdin") if isinstance(data, bytes) else data


def read_prompts_file(path: Path) -> list[str]:
    """One prompt per non-blank line (a trailing \\r\\n or \\n removed), each line and the whole bounded."""
    label = f"--prompts-file {path}"
    if path.is_dir():
        raise InputError(f"{label}: is a folder; pass a text file with one prompt per line")
    try:
        with open(path, "rb") as file:
            return _read_lines(file, label)
    except OSError as e:
        raise InputError(f"{label}: {e.strerror or e}") from e


def _read_lines(file, label: str) -> list[str]:
    prompts, offset, number = [], 0, 0
    # readline(limit) stops at the limit, so a file with no newline (/dev/zero) costs one bounded read
    while line := file.readline(MAX_PROMPT_BYTES + 1):
        number += 1
        if len(line) > MAX_PROMPT_BYTES and not line.endswith(b"\n"):
            raise InputError(f"{label}: line {number} is longer than {MAX_PROMPT_BYTES:,} bytes, the limit for one prompt")
        if offset + len(line) > MAX_INPUT_BYTES:
            raise InputError(f"{label}: more than {MAX_INPUT_BYTES:,} bytes of prompts; split the file")
        text = decode_utf8(line, label, offset, number).rstrip("\r\n")
        offset += len(line)
        if text.strip():
            prompts.append(text)
    return prompts


def decode_utf8(data: bytes, label: str, offset: int = 0, line: int | None = None) -> str:
    """Strict UTF-8; the error gives the absolute byte offset (and line) of the first bad byte."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        where = f"line {line}, " if line is not None else ""
        raise InputError(f"{label}: {where}byte {offset + e.start} (0x{data[e.start]:02x}) is not UTF-8; "
                         "save the text as UTF-8") from None  # fmt: skip


def stdin_waiting(stdin) -> bool:
    """True when stdin already holds bytes: asked of the OS, nothing read, so a shell loop that
    feeds the surrounding script on stdin keeps all of its input."""
    try:
        fd = stdin.fileno()
        mode = os.fstat(fd).st_mode
        if os.isatty(fd):
            return False
        if stat.S_ISREG(mode):
            return os.fstat(fd).st_size > os.lseek(fd, 0, os.SEEK_CUR)
        if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
            waiting = fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0")
            return struct.unpack("i", waiting)[0] > 0
    except (AttributeError, OSError, ValueError):  # no real descriptor (tests, IDEs): nothing waits
        pass
    return False


