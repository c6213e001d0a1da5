"""Hostile checkpoint files: every one ends in one line on stderr and exit 2, never loads, never hangs.

Each case damages a fresh copy of the tiny checkpoint the way a broken or malicious Hub repo could
(deep JSON, a directory where a file belongs, bytes that are not UTF-8, fields of the wrong type, ids
outside the vocabulary, a template that divides by zero, control characters in names) and runs the
real command line on it. The heavy cases (what would allocate gigabytes if a check regressed) run in
a subprocess under an address-space limit and a timeout, so a regression fails instead of eating
the machine.
"""

import json
import os
import resource
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from make_tiny_checkpoint import make_tiny_checkpoint
from safetensors.torch import load_file, save_file

from qwen3_scratch import CheckpointError, load_model
from qwen3_scratch.cli.generate import main
from qwen3_scratch.generation.loops import generate_tokens

DEEP = "[" * 100_000 + "]" * 100_000  # far past Python's recursion limit
INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("hostile") / "tiny")


@pytest.fixture
def folder(pristine, tmp_path):
    return Path(shutil.copytree(pristine, tmp_path / "ckpt"))


def edit_json(path, change):
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def first_shard(folder):
    return folder / sorted(set(json.loads((folder / INDEX).read_text())["weight_map"].values()))[0]


def replace_with_directory(path):
    path.unlink()
    path.mkdir()
    (path / "inside").write_text("x")


def write_template(folder, template):
    (folder / "chat_template.jinja").write_text(template)


def big_token_id(folder):
    """Move one ordinary token to id 5000, far past the tiny model's embedding rows."""

    def move(tokenizer):
        vocab = tokenizer["model"]["vocab"]
        vocab[next(token for token, i in vocab.items() if i == 1000)] = 5000

    edit_json(folder / "tokenizer.json", move)


def add_tensor(folder, name):
    """Add a tensor to a shard (and the index), under a name the file chose."""
    shard = first_shard(folder)
    tensors = load_file(shard)
    tensors[name] = torch.zeros(2)
    save_file(tensors, shard, metadata={"format": "pt"})
    edit_json(folder / INDEX, lambda d: d["weight_map"].update({name: shard.name}))


# (id, damage, text the one line must contain)
CASES = [
    # JSON nested past the recursion limit, in every JSON file we parse ourselves
    ("deep-config", lambda f: (f / "config.json").write_text(DEEP), "config.json: JSON nested too deeply"),
    ("deep-index", lambda f: (f / INDEX).write_text(DEEP), f"{INDEX}: JSON nested too deeply"),
    ("deep-tokenizer-config", lambda f: (f / "tokenizer_config.json").write_text(DEEP), "tokenizer_config.json"),
    ("deep-generation-config", lambda f: (f / "generation_config.json").write_text(DEEP), "generation_config.json"),
    ("deep-tokenizer", lambda f: (f / "tokenizer.json").write_text('{"model":' + DEEP + "}"), "tokenizer.json"),
    # a directory where a file belongs
    ("dir-config", lambda f: replace_with_directory(f / "config.json"), "config.json is a folder, not a file"),
    ("dir-index", lambda f: replace_with_directory(f / INDEX), f"{INDEX} is a directory"),
    ("dir-shard", lambda f: replace_with_directory(first_shard(f)), "is a directory, not a weight file"),
    ("dir-tokenizer", lambda f: replace_with_directory(f / "tokenizer.json"), "tokenizer.json is a directory"),
    ("dir-tokenizer-config", lambda f: replace_with_directory(f / "tokenizer_config.json"), "is a directory"),
    ("dir-generation-config", lambda f: replace_with_directory(f / "generation_config.json"), "is a directory"),
    ("dir-template", lambda f: (f / "chat_template.jinja").mkdir(), "chat_template.jinja is a directory"),
    # bytes that are not UTF-8
    ("latin1-config", lambda f: (f / "config.json").write_bytes(b'{"model_type": "qw\xe9n3"}'), "config.json is not UTF-8"),
    ("latin1-index", lambda f: (f / INDEX).write_bytes(b'{"weight_map": {"\xff": "x"}}'), f"{INDEX} is not UTF-8"),
    ("latin1-tokenizer-config", lambda f: (f / "tokenizer_config.json").write_bytes(b"{\xff}"), "is not UTF-8"),
    ("latin1-generation-config", lambda f: (f / "generation_config.json").write_bytes(b"{\xc3}"), "is not UTF-8"),
    ("latin1-tokenizer", lambda f: (f / "tokenizer.json").write_bytes(b"{\xfe\xff}"), "tokenizer.json is not UTF-8"),
    ("latin1-template", lambda f: (f / "chat_template.jinja").write_bytes(b"{{ '\xff' }}"), "chat_template.jinja is not UTF-8"),
    # tokenizer_config.json fields of the wrong type
    ("eos-token-number", lambda f: edit_json(f / "tokenizer_config.json", lambda d: d.update(eos_token=5)), "eos_token must be"),
    ("pad-token-list", lambda f: edit_json(f / "tokenizer_config.json", lambda d: d.update(pad_token=["x"])), "pad_token must be"),
    ("eos-content-number", lambda f: edit_json(f / "tokenizer_config.json", lambda d: d.update(eos_token={"content": 1})), "eos_token"),
    ("added-tokens-list", lambda f: edit_json(f / "tokenizer_config.json", lambda d: d.update(added_tokens_decoder=[1])), "added_tokens_decoder must be"),
    ("added-token-key", lambda f: edit_json(f / "tokenizer_config.json", lambda d: d.update(added_tokens_decoder={"x": "<|im_end|>"})), "added_tokens_decoder"),
    ("chat-template-int", lambda f: edit_json(f / "tokenizer_config.json", lambda d: d.update(chat_template=42)), "chat_template must be"),
    ("chat-template-bad-list", lambda f: edit_json(f / "tokenizer_config.json", lambda d: d.update(chat_template=[{"name": 1}])), "chat_template must be"),
    # ids outside the model's vocabulary
    ("tokenizer-beyond-vocab", big_token_id, "has token ids up to 5000, but"),
    ("eos-token-unknown", lambda f: edit_json(f / "tokenizer_config.json", lambda d: d.update(eos_token="<|nope|>")), "is not a token of tokenizer.json"),
    ("config-eos-beyond-vocab", lambda f: edit_json(f / "config.json", lambda d: d.update(eos_token_id=10**6)), "eos_token_id must be a token id"),
    ("config-eos-negative", lambda f: edit_json(f / "config.json", lambda d: d.update(eos_token_id=[-1])), "eos_token_id"),
    ("generation-eos-beyond-vocab", lambda f: edit_json(f / "generation_config.json", lambda d: d.update(eos_token_id=[1, 10**6])), "outside the vocabulary"),
    # generation_config.json values of the wrong type or range
    ("generation-temperature-text", lambda f: edit_json(f / "generation_config.json", lambda d: d.update(temperature="hot")), "temperature"),
    ("generation-top-p-range", lambda f: edit_json(f / "generation_config.json", lambda d: d.update(top_p=2)), "top_p"),
    ("generation-top-k-negative", lambda f: edit_json(f / "generation_config.json", lambda d: d.update(top_k=-1)), "top_k"),
    ("generation-do-sample-text", lambda f: edit_json(f / "generation_config.json", lambda d: d.update(do_sample="yes")), "do_sample"),
    ("generation-eos-text", lambda f: edit_json(f / "generation_config.json", lambda d: d.update(eos_token_id="x")), "eos_token_id"),
    ("generation-not-object", lambda f: (f / "generation_config.json").write_text("[1]"), "expected a JSON object"),
    # chat-template errors that are not TemplateError
    ("template-zero-division", lambda f: write_template(f, "{{ 1 / 0 }}"), "chat_template.jinja: ZeroDivisionError"),
    ("template-recursion", lambda f: write_template(f, "{% macro m() %}{{ m() }}{% endmacro %}{{ m() }}"), "RecursionError"),
    ("template-type-error", lambda f: write_template(f, "{{ messages + 1 }}"), "chat_template.jinja: TypeError"),
    ("template-memory-bomb", lambda f: write_template(f, "{{ 'a' * 10**10 }}"), "too large"),
    # config.json against the tensors the files list
    ("config-more-layers", lambda f: edit_json(f / "config.json", lambda d: d.update(num_hidden_layers=1000)), "num_hidden_layers=1000, but"),
    ("config-bigger-vocab", lambda f: edit_json(f / "config.json", lambda d: d.update(vocab_size=2**20)), "embed_tokens.weight has shape"),
    ("config-string-size", lambda f: edit_json(f / "config.json", lambda d: d.update(hidden_size="64")), "hidden_size must be an integer"),
]


@pytest.mark.parametrize("damage, needle", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_hostile_file_ends_in_one_line_and_exit_2(folder, capsys, damage, needle):
    damage(folder)
    code = main(["--model", str(folder), "--prompt", "hi", "--max-new-tokens", "2"])
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, f"expected exit 2 and one line, got {code}:\n{err}"
    assert needle in lines[0], f"{needle!r} missing from: {lines[0]}"
    assert out == "", "nothing may be generated from a hostile checkpoint"


@pytest.mark.parametrize(
    "damage",
    [
        lambda f: edit_json(f / INDEX, lambda d: d["weight_map"].update({"model.norm.weight": "\x1b[2J\x1b[31mevil\n.safetensors"})),
        lambda f: add_tensor(f, "model.extra\x1b]0;pwned\x07\nsecond line"),
        lambda f: write_template(f, "{{ raise_exception('\x1b[31mred\nforged line') }}"),
        lambda f: write_template(f, "{{ messages[0]['\x1b[31m'] / 0 }}"),
    ],
    ids=["index-shard-name", "tensor-name", "template-message", "template-undefined-key"],
)
def test_control_characters_from_files_never_reach_the_terminal(folder, capsys, damage):
    damage(folder)
    assert main(["--model", str(folder), "--prompt", "hi", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert not any(c in err.strip() for c in "\x1b\x07\r\n"), f"raw control characters in: {err!r}"
    assert "\\x1b" in err, "the escape must still be visible, as text"


def test_library_errors_escape_file_controlled_names(folder):
    """The API's own messages are escaped at the source, not only by the CLI."""
    add_tensor(folder, "model.extra\x1b[31m")
    with pytest.raises(CheckpointError) as error:
        load_model(folder)
    assert "\x1b" not in str(error.value) and "\\x1b[31m" in str(error.value)


def test_index_shard_names_must_stay_inside_the_folder(folder):
    outside = folder.parent / "outside.safetensors"
    shutil.copy(first_shard(folder), outside)
    edit_json(folder / INDEX, lambda d: d["weight_map"].update({k: "../outside.safetensors" for k in list(d["weight_map"])[:1]}))
    with pytest.raises(CheckpointError, match="is not a file name in the checkpoint folder"):
        load_model(folder)


# ---- RoPE tables: sized to the generation, grown on demand ------------------------------------


def test_rope_tables_grown_on_demand_equal_tables_built_at_once(pristine):
    model = load_model(pristine, dtype="float32")
    full_cos, full_sin = model.rope_cos.clone(), model.rope_sin.clone()  # the tiny context (2048) fits at once
    model.build_rope_tables(length=3)
    model.reserve_positions(1500)
    assert 1500 <= model.rope_cos.shape[0] <= 2048
    n = model.rope_cos.shape[0]
    assert torch.equal(model.rope_cos, full_cos[:n]) and torch.equal(model.rope_sin, full_sin[:n])


def test_generation_grows_the_tables_and_gives_the_same_tokens(pristine):
    prompt = [[5, 17, 99, 3, 250, 41]]
    model = load_model(pristine, dtype="float32")
    expected = [t.tolist() for t in generate_tokens(model, prompt, 16)]
    model.build_rope_tables(length=4)  # far shorter than prompt + 16 new tokens
    assert [t.tolist() for t in generate_tokens(model, prompt, 16)] == expected
    assert model.rope_cos.shape[0] >= 22


def test_huge_configured_context_does_not_size_the_tables(folder):
    edit_json(folder / "config.json", lambda d: d.update(max_position_embeddings=2**24))
    model = load_model(folder)
    assert model.rope_cos.shape[0] <= 4096, "tables follow what generations need, not max_position_embeddings"


# ---- heavy cases, under an address-space limit and a timeout ---------------------------------

HEAVY_LIMIT_BYTES = 3 * 2**30  # torch alone maps ~1 GiB of address space; no case may need much more
# Each would allocate gigabytes, or run for minutes, if its check regressed. A 16M-token context is
# a legal config (it must load and generate, in little memory); every other case is refused.
LEGAL_BUT_LARGE = {"max_position_embeddings": lambda f: edit_json(f / "config.json", lambda d: d.update(max_position_embeddings=2**24))}
HEAVY_CASES = {
    "layers": lambda f: edit_json(f / "config.json", lambda d: d.update(num_hidden_layers=4096)),
    "vocab": lambda f: edit_json(f / "config.json", lambda d: d.update(vocab_size=2**24, eos_token_id=1)),
    "intermediate": lambda f: edit_json(f / "config.json", lambda d: d.update(intermediate_size=2**20)),
    "template": lambda f: write_template(f, "{{ 'ab' * 2**31 }}{{ [0] * 10**9 }}"),
    "deep-json": lambda f: (f / "config.json").write_text("[" * 10**7),
    "header-length": lambda f: first_shard(f).write_bytes(struct.pack("<Q", 2**63) + b"{}"),
}


def limit_address_space():
    resource.setrlimit(resource.RLIMIT_AS, (HEAVY_LIMIT_BYTES, HEAVY_LIMIT_BYTES))


def test_heavy_hostile_files_run_in_bounded_memory_and_time(pristine, tmp_path):
    folders = {}
    for name, damage in {**LEGAL_BUT_LARGE, **HEAVY_CASES}.items():
        folders[name] = Path(shutil.copytree(pristine, tmp_path / name))
        damage(folders[name])
    # One interpreter runs every case (one torch import), through the real CLI entry point.
    script = (
        "import sys, json\nfrom qwen3_scratch.cli.generate import main\n"
        "for folder in sys.argv[1:]:\n"
        "    code = main(['--model', folder, '--prompt', 'hi', '--max-new-tokens', '2', '--temperature', '0'])\n"
        "    print(json.dumps([folder, code]), flush=True)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run(
        [sys.executable, "-c", script, *map(str, folders.values())],
        capture_output=True, text=True, timeout=120, preexec_fn=limit_address_space, env=env,
    )  # fmt: skip
    codes = dict(json.loads(line) for line in done.stdout.splitlines() if line.startswith("["))
    errors = done.stderr.strip().splitlines()
    assert "Traceback" not in done.stderr and done.returncode == 0, done.stderr[-3000:]
    expected = {str(folders[name]): 0 if name in LEGAL_BUT_LARGE else 2 for name in folders}
    assert codes == expected, f"exit codes {codes}:\n{done.stderr}"
    assert len(errors) == len(HEAVY_CASES), "one line per refused case:\n" + done.stderr
