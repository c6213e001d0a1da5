"""Work a start leaves for after its process exits: stored kernels (kernels/aot_build.py), tokenizer tables
(text/bpe.py). Each runs in a niced process of its own that waits for the caller to exit, then runs a module's
`main(args)`.

Built alongside, such work slowed the process that started it: the kernel builder cost that process's first token
~2 s (+6%) on 2 cores, and its decode too. The process runs in a session of its own (the terminal's Ctrl-C and
hangup do not reach it), and Linux gives each session an autogroup that shares the CPU with the others as an equal,
whatever the nice values of the processes inside (CONFIG_SCHED_AUTOGROUP: on in Ubuntu, Fedora and this project's
machines). At nice 19 alone, a busy process so started took a core from the user's next command and its two decode
threads waited on each other: a 0.6B int8 decode ran 0.24 tok/s instead of 13.87 (AMD EPYC Zen 3). So the process
lowers its autogroup's nice too (any process may lower its own): 13.07 tok/s beside it (docs/performance.md).
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

SCRIPT = """import importlib, os, sys, time
try:
    with open("/proc/self/autogroup", "w") as group:  # this session's share of the CPU, as low as it goes
        group.write("19")
except OSError:  # not Linux, or no autogroups: nice 19 is all there is
    pass
while os.getppid() == int(sys.argv[1]):
    time.sleep(0.5)
sys.exit(importlib.import_module(sys.argv[2]).main(sys.argv[3:]))
"""


def start(module: str, args: list[str], log: Path) -> None:
    """Run `module.main(args)` once this process has exited, niced from its first instruction (the user's tokens
    come first), its output appended to `log`. OSError if it cannot be started (a log that cannot be written)."""
    nice = ["nice", "-n", "19"] if shutil.which("nice") else []
    with open(log, "a") as out:
        subprocess.Popen([*nice, sys.executable, "-c", SCRIPT, str(os.getpid()), module, *args],
                         stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True)  # fmt: skip
