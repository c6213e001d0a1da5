"""What the checkpoint says about generating: generation_config.json's defaults, and the ids that end a
generation.

A checkpoint ships its recommended sampling settings (Qwen3: temperature 0.6, top-k 20, top-p 0.95)
and its end-of-sequence ids in generation_config.json. The file is downloaded, so it is untrusted:
every value is checked by the same rules as a request's (logits.py), and the error names the file.
`SamplingParams.with_defaults` fills a request's unset fields from what `load_generation_config` returns.
"""

from pathlib import Path

from qwen3_scratch.errors import GenerationError, printable
from qwen3_scratch.files import read_json

from .logits import check_min_p, check_temperature, check_top_k, check_top_p, is_int, require


def _read_eos(value, path: Path) -> list[int]:
    ids = [value] if is_int(value) else value
    if not isinstance(ids, list) or not all(is_int(i) for i in ids):
        raise GenerationError(f"{path}: eos_token_id must be an integer or a list of integers, "
                              f"got {printable(repr(value), 80)}")  # fmt: skip
    return ids


def stop_token_ids(generation_config: dict, config_eos: list[int], tokenizer_eos: int | None) -> list[int]:
    """The ids that end a generation: generation_config.json's eos_token_id (Qwen3 lists <|im_end|> and
    <|endoftext|> there), else config.json's, else the tokenizer's eos_token."""
    ids = generation_config.get("eos_token_id") or config_eos
    if not ids and tokenizer_eos is not None:
        ids = [tokenizer_eos]
    return list(ids)


def load_generation_config(checkpoint_dir, vocab_size: int | None = None) -> dict:
    """The checkpoint's generation defaults from generation_config.json; {} when there is none.

    Returns only the keys the file sets (null counts as unset), checked and normalised:
    temperature, top_k, top_p, min_p, do_sample (bool), eos_token_id (always list[int], each id
    within vocab_size when given), max_new_tokens, max_length.
    """
    path = Path(checkpoint_dir) / "generation_config.json"
    if not path.exists():
        return {}
    raw = {key: value for key, value in read_json(path, GenerationError, "fix or delete the file").items()
           if value is not None}  # fmt: skip
    checks = {"temperature": check_temperature, "top_k": check_top_k, "top_p": check_top_p, "min_p": check_min_p}
    defaults: dict = {}
    for key, check in checks.items():
        if key in raw:
            check(raw[key], label=f"{path}: {key}")
            defaults[key] = raw[key]
    for key in ("max_new_tokens", "max_length"):
        if key in raw:
            require(is_int(raw[key]) and raw[key] > 0, f"{path}: {key}", "a positive integer", raw[key])
            defaults[key] = raw[key]
    if "do_sample" in raw:
        require(isinstance(raw["do_sample"], bool), f"{path}: do_sample", "true or false", raw["do_sample"])
        defaults["do_sample"] = raw["do_sample"]
    if "eos_token_id" in raw:
        defaults["eos_token_id"] = _read_eos(raw["eos_token_id"], path)
        outside = [i for i in defaults["eos_token_id"] if vocab_size is not None and not 0 <= i < vocab_size]
        if outside:  # such an id can never be sampled, so generation would never stop on it
            raise GenerationError(f"{path}: eos_token_id {outside[0]} is outside the vocabulary "
                                  f"[0, {vocab_size}) of config.json; fix or delete the file")  # fmt: skip
    return defaults
