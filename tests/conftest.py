import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Tests import the checkpoint builders in tests/ and the scripts in scripts/ (make_tiny_checkpoint, ...).
for folder in (ROOT / "tests", ROOT / "scripts"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
