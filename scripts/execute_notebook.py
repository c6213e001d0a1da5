"""Re-run the walkthrough notebook from a clean kernel and save it with its outputs, in place.

    python scripts/execute_notebook.py                     # notebooks/qwen3_walkthrough.ipynb
    python scripts/execute_notebook.py path/to/other.ipynb --timeout 600

The committed notebook carries the outputs of this command, so GitHub shows real figures. Old outputs
are cleared first, so nothing from an earlier run survives, and the file is only written when every
cell succeeded: a failing run leaves the committed notebook as it was and exits with code 1.
"""

import argparse
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "qwen3_walkthrough.ipynb"


def clear_outputs(notebook) -> None:
    for cell in notebook.cells:
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
        cell.metadata.pop("execution", None)


def execute(path: Path, timeout: int) -> None:
    notebook = nbformat.read(path, as_version=4)
    clear_outputs(notebook)
    client = NotebookClient(
        notebook,
        timeout=timeout,  # seconds per cell
        kernel_name="python3",
        record_timing=False,  # no per-cell timestamps: they would change the file on every run
        resources={"metadata": {"path": str(path.parent)}},  # run from the notebook's folder, as Jupyter does
    )
    client.execute()
    nbformat.write(notebook, path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Execute a notebook in place with fresh outputs.")
    parser.add_argument("notebook", nargs="?", type=Path, default=NOTEBOOK, help="default: %(default)s")
    parser.add_argument("--timeout", type=int, default=600, help="seconds allowed per cell (default %(default)s)")
    args = parser.parse_args(argv)
    path = args.notebook.resolve()
    start = time.perf_counter()
    try:
        execute(path, args.timeout)
    except CellExecutionError as error:
        print(f"{path}: a cell failed; the file was not changed\n{error}", file=sys.stderr)
        return 1
    size = path.stat().st_size
    print(f"executed {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path} "
          f"in {time.perf_counter() - start:.0f} s; {size / 1024:.0f} KiB with outputs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
