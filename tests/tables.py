"""A Tokenizer on text/bpe.py's table, for tests: what a later start gets, with the table built in memory."""

import json
from pathlib import Path

from qwen3_scratch.text.bpe import ByteLevelBPE
from qwen3_scratch.text.tokenizer import Tokenizer


def with_table(folder) -> Tokenizer:
    """The checkpoint's Tokenizer running bpe.py's table (built here, neither read from nor stored in a cache)."""
    tokenizer = Tokenizer.from_checkpoint(folder)
    tokenizer.bpe = ByteLevelBPE.from_json(json.loads((Path(folder) / "tokenizer.json").read_text(encoding="utf-8")))
    assert tokenizer.bpe is not None, f"{folder}: bpe.py runs Qwen's tokenizer.json"
    return tokenizer
