"""resolve_checkpoint and verify_checkpoint against a fake Hugging Face Hub on 127.0.0.1.

The fake Hub serves a folder written by `build_checkpoint` through the few endpoints huggingface_hub's
`snapshot_download` calls, and records every request, so the tests can say exactly what was fetched.
Nothing here reaches the real Hub.
"""

import errno
import json
import re
import shutil
import socket
import time

import pytest
import torch
from huggingface_hub import constants
from transformers import AutoModelForCausalLM

from checkpoints import build_checkpoint, load_reference
from fake_hub import COMMIT, GATED, make_hf_hermetic, serve_fake_hub
from qwen3_scratch.errors import CheckpointError, HubError
from qwen3_scratch.hub import resolve_checkpoint, verify_checkpoint

REPO = "fake-org/tiny-qwen3"
# Files a real Qwen repo ships that the model never reads: they must not be downloaded.
UNNEEDED = ["pytorch_model.bin", "original/consolidated.00.pth", "original/params.json"]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """The repo's files: a sharded tiny Qwen3, tokenizer-ish files, and files we must not download."""
    folder = build_checkpoint(tmp_path_factory.mktemp("hub") / "tiny-qwen3", max_shard_size="40KB")
    for name in ["tokenizer.json", "tokenizer_config.json", "vocab.json"]:
        (folder / name).write_text("{}")
    (folder / "merges.txt").write_text("#version: 0.2\n")
    (folder / "LICENSE").write_text("Apache-2.0\n")
    for name in UNNEEDED:
        (folder / name).parent.mkdir(exist_ok=True)
        (folder / name).write_bytes(b"not needed" * 100)
    return folder


@pytest.fixture(autouse=True)
def hermetic_hf(tmp_path, monkeypatch):
    make_hf_hermetic(tmp_path, monkeypatch)


@pytest.fixture
def hub(source):
    with serve_fake_hub({REPO: source, GATED: source}) as server:
        yield server


def download(hub, weights, **kwargs):
    return resolve_checkpoint(REPO, weights, endpoint=hub.url, progress=False, **kwargs)


def file_gets(hub):
    return [path for method, path in hub.requests if method == "GET" and "/resolve/" in path]


def files_in(folder):
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}


def shards(folder):
    return sorted(set(json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"].values()))


def test_download_fetches_only_needed_files_and_loads_in_transformers(hub, source, tmp_path):
    folder = download(hub, tmp_path / "weights")
    assert folder == tmp_path / "weights" / "tiny-qwen3", "a Hub id downloads into weights_dir/<name>"
    downloaded = files_in(folder) - {p for p in files_in(folder) if p.startswith(".cache/")}  # hf's bookkeeping
    wanted = files_in(source) - set(UNNEEDED)
    assert downloaded == wanted, f"unexpected {downloaded - wanted}, missing {wanted - downloaded}"
    assert len(shards(folder)) > 1, "the test checkpoint should be sharded"
    for name in wanted:
        assert (folder / name).read_bytes() == (source / name).read_bytes(), f"{name} differs from the Hub's"
    ours = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()
    reference = load_reference(source).state_dict()
    assert ours.keys() == reference.keys()
    for key, tensor in reference.items():
        assert torch.equal(ours[key], tensor), f"{key} differs after the download"


def test_second_resolve_downloads_nothing(hub, tmp_path):
    download(hub, tmp_path)
    first = len(file_gets(hub))
    download(hub, tmp_path)
    assert len(file_gets(hub)) == first, f"re-downloaded {file_gets(hub)[first:]}"


@pytest.mark.parametrize("damage", ["delete", "truncate", "lfs-pointer"])
def test_damaged_shard_is_fetched_again(hub, tmp_path, damage):
    folder = download(hub, tmp_path)
    shard = folder / shards(folder)[-1]
    original = shard.read_bytes()
    if damage == "delete":
        shard.unlink()
    elif damage == "truncate":
        shard.write_bytes(original[: len(original) // 2])
    else:
        shard.write_text("version https://git-lfs.github.com/spec/v1\noid sha256:abc\nsize 123\n")
    before = len(file_gets(hub))
    assert download(hub, tmp_path) == folder
    assert shard.read_bytes() == original, f"{shard.name} was not repaired"
    assert file_gets(hub)[before:] == [f"/{REPO}/resolve/{COMMIT}/{shard.name}"], "only the damaged shard is fetched"


def test_transfer_cut_mid_file_resumes_with_a_range_request(hub, source, tmp_path):
    shard = shards(source)[0]
    cut = (source / shard).stat().st_size // 2
    hub.cut_once[shard] = cut
    folder = download(hub, tmp_path)
    assert (folder / shard).read_bytes() == (source / shard).read_bytes()
    assert hub.ranges == [f"{shard}: bytes={cut}-"], "the retry should ask only for what is missing"


def test_local_files_only_names_the_damaged_shard(hub, tmp_path):
    folder = download(hub, tmp_path)
    shard = folder / shards(folder)[0]
    shard.write_bytes(shard.read_bytes()[:100])
    requests = len(hub.requests)
    with pytest.raises(CheckpointError, match=re.escape(shard.name) + ".*without --local-files-only"):
        download(hub, tmp_path, local_files_only=True)
    assert len(hub.requests) == requests, "local_files_only must not touch the network"


def test_local_files_only_uses_a_complete_download_without_network(hub, tmp_path):
    folder = download(hub, tmp_path)
    requests = len(hub.requests)
    assert download(hub, tmp_path, local_files_only=True) == folder
    assert len(hub.requests) == requests, "local_files_only must not touch the network"


def test_local_files_only_without_a_download_says_to_download(hub, tmp_path):
    with pytest.raises(HubError, match=f"{REPO} is not in .*tiny-qwen3; run without --local-files-only"):
        download(hub, tmp_path, local_files_only=True)
    assert hub.requests == [], "local_files_only must not touch the network"


def test_hf_hub_offline_explains_itself_instead_of_failing_a_request(hub, tmp_path, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(HubError, match=f"{REPO} is not in .*HF_HUB_OFFLINE.* is set: unset it to download it"):
        download(hub, tmp_path)
    assert hub.requests == []


def test_unknown_repo_is_named_in_the_error(hub, tmp_path):
    with pytest.raises(HubError, match="fake-org/missing was not found on the Hub: check the id"):
        resolve_checkpoint("fake-org/missing", tmp_path, endpoint=hub.url, progress=False)


def test_gated_repo_asks_to_accept_the_license_and_log_in(hub, tmp_path):
    with pytest.raises(HubError, match=f"{GATED} is gated: accept its license.*hf auth login"):
        resolve_checkpoint(GATED, tmp_path, endpoint=hub.url, progress=False)


def test_unknown_revision_is_named_in_the_error(hub, tmp_path):
    with pytest.raises(HubError, match="no revision 'v9' on the Hub"):
        download(hub, tmp_path, revision="v9")


def closed_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_hub_is_a_network_error_quickly(tmp_path, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_ETAG_TIMEOUT", 2)
    start = time.monotonic()
    with pytest.raises(HubError, match=f"could not reach the Hugging Face Hub .* {REPO} .*check the network"):
        resolve_checkpoint(REPO, tmp_path, endpoint=f"http://127.0.0.1:{closed_port()}", progress=False)
    assert time.monotonic() - start < 5, "a refused connection must fail fast, not retry for long"


def test_silent_hub_times_out_instead_of_hanging(tmp_path, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_ETAG_TIMEOUT", 1)
    with socket.socket() as silent:  # the kernel accepts the connection; nobody ever answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
        start = time.monotonic()
        with pytest.raises(HubError, match="could not reach the Hugging Face Hub .*Timeout"):
            resolve_checkpoint(REPO, tmp_path, endpoint=endpoint, progress=False)
    assert time.monotonic() - start < 5, "wait HF_HUB_ETAG_TIMEOUT seconds for the Hub's first answer, not forever"


def test_full_disk_is_reported_as_a_disk_problem(hub, tmp_path, monkeypatch):
    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("qwen3_scratch.snapshot.fetch_file", no_space)
    with pytest.raises(HubError, match=f"could not write {REPO} into .*No space left.*free some disk space"):
        download(hub, tmp_path)


def test_unreachable_hub_falls_back_to_a_complete_download(hub, tmp_path):
    folder = download(hub, tmp_path)
    offline = f"http://127.0.0.1:{closed_port()}"
    assert resolve_checkpoint(REPO, tmp_path, endpoint=offline, progress=False) == folder


def test_local_folder_is_returned_without_network(source, monkeypatch):
    monkeypatch.setattr("qwen3_scratch.snapshot.get_session", None)  # any download attempt would crash
    assert resolve_checkpoint(str(source)) == source


@pytest.mark.parametrize("model", ["./no-such-folder", "/no/such/folder", "~/no-such-folder", "a/b/c", "tiny"])
def test_missing_local_path_is_a_clear_error(model, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match=f"no checkpoint folder at {re.escape(model)}"):
        resolve_checkpoint(model, tmp_path)


def test_a_file_is_not_a_checkpoint_folder(source):
    with pytest.raises(CheckpointError, match="no checkpoint folder at .*config.json"):
        resolve_checkpoint(str(source / "config.json"))


@pytest.fixture
def copy_of(source, tmp_path):
    """A writable copy of the checkpoint's config, index and shards."""
    folder = tmp_path / "copy"
    folder.mkdir()
    for name in ["config.json", "model.safetensors.index.json", *shards(source)]:
        (folder / name).write_bytes((source / name).read_bytes())
    return folder


def test_verify_accepts_a_complete_checkpoint(copy_of):
    assert verify_checkpoint(str(copy_of)) == copy_of


@pytest.mark.parametrize(
    "damage, message",
    [
        ("missing shard", r"model-00002-of-\d+\.safetensors is missing \(named in model.safetensors.index.json\)"),
        ("lfs pointer", r"model-00002-of-\d+\.safetensors is a git-LFS pointer"),
        ("truncated shard", r"model-00002-of-\d+\.safetensors is truncated"),
        ("empty shard", r"model-00002-of-\d+\.safetensors is empty"),
        ("missing weights", r"has neither model\.safetensors nor model\.safetensors\.index\.json"),
    ],
)
def test_verify_names_the_broken_file(copy_of, damage, message):
    shard = copy_of / shards(copy_of)[1]
    if damage == "missing shard":
        shard.unlink()
    elif damage == "lfs pointer":
        shard.write_text("version https://git-lfs.github.com/spec/v1\noid sha256:abc\nsize 123\n")
    elif damage == "truncated shard":
        shard.write_bytes(shard.read_bytes()[:-1])
    elif damage == "empty shard":
        shard.write_bytes(b"")
    else:
        (copy_of / "model.safetensors.index.json").unlink()
    with pytest.raises(CheckpointError, match=message + ".*download"):
        verify_checkpoint(copy_of)
