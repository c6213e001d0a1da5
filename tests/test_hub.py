"""resolve_checkpoint and verify_checkpoint against a fake Hugging Face Hub on 127.0.0.1.

The fake Hub serves a folder written by `build_checkpoint` through the endpoints a download calls, and
records every request, so the tests can say exactly what was fetched. It also misbehaves on purpose:
tampered bytes, a trickle, an endless body, a connection cut. Nothing here reaches the real Hub; every
test is bounded in time (short deadlines through DownloadLimits, explicit timeouts on subprocesses).
"""

import errno
import fcntl
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from checkpoints import build_checkpoint, load_reference
from cli_helpers import assert_one_line_error, cli
from fake_hub import COMMIT, GATED, make_hf_hermetic, serve_fake_hub
from huggingface_hub import constants, snapshot_download
from make_tiny_checkpoint import make_tiny_checkpoint
from transformers import AutoModelForCausalLM

from qwen3_scratch.checkpoint.download import PARTIAL_DIR, DownloadLimits
from qwen3_scratch.checkpoint.hub import resolve_checkpoint, verify_checkpoint
from qwen3_scratch.checkpoint.snapshot import RECORD
from qwen3_scratch.errors import CheckpointError, HubError

REPO = "fake-org/tiny-qwen3"
CHAT_REPO = "fake-org/tiny-chat"  # a checkpoint the CLI can run: real tokenizer and chat template
V1_COMMIT = "1111111111111111111111111111111111111111"
ROOT = Path(__file__).resolve().parents[1]
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


@pytest.fixture(scope="module")
def chat_source(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("hub") / "tiny-chat")


@pytest.fixture
def hub(source, chat_source):
    with serve_fake_hub({REPO: source, GATED: source, CHAT_REPO: chat_source}) as server:
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


@pytest.mark.parametrize("ranges", ["honoured", "ignored"])
def test_transfer_cut_mid_file_resumes_with_a_range_request(hub, source, tmp_path, ranges):
    shard = shards(source)[0]
    cut = (source / shard).stat().st_size // 2
    hub.cut_once[shard] = cut
    hub.ignore_ranges = ranges == "ignored"  # then the whole file comes again, and must replace the partial one
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

    monkeypatch.setattr("qwen3_scratch.checkpoint.snapshot.fetch_file", no_space)
    with pytest.raises(HubError, match=f"could not write {REPO} into .*No space left.*free some disk space"):
        download(hub, tmp_path)


def test_unreachable_hub_falls_back_to_a_complete_download(hub, tmp_path):
    folder = download(hub, tmp_path)
    offline = f"http://127.0.0.1:{closed_port()}"
    assert resolve_checkpoint(REPO, tmp_path, endpoint=offline, progress=False) == folder


def test_local_folder_is_returned_without_network(source, monkeypatch):
    monkeypatch.setattr("huggingface_hub.utils.get_session", None)  # any download attempt would crash
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


def test_a_folder_without_config_says_it_is_not_a_checkpoint_and_names_the_one_inside(source, tmp_path):
    parent = tmp_path / "weights"
    shutil.copytree(source, parent / "tiny-qwen3")
    with pytest.raises(CheckpointError, match=f"{parent} is not a checkpoint folder: it has no config.json; .*"
                                              f"did you mean {parent / 'tiny-qwen3'}"):  # fmt: skip
        resolve_checkpoint(str(parent))


def test_a_download_that_lost_its_config_is_told_to_download_again(hub, tmp_path):
    folder = download(hub, tmp_path)
    (folder / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config\.json is missing; re-run the download"):
        verify_checkpoint(folder)
    assert download(hub, tmp_path) == folder, "downloading again repairs it"


def test_weights_path_from_another_folder_names_the_folder_looked_for_and_never_asks_the_hub(hub, tmp_path,
                                                                                              monkeypatch):  # fmt: skip
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    with pytest.raises(CheckpointError, match=f"no checkpoint folder at weights/tiny-qwen3 .looked for "
                                              f"{elsewhere / 'weights' / 'tiny-qwen3'}"):  # fmt: skip
        resolve_checkpoint("weights/tiny-qwen3", "weights", endpoint=hub.url)
    assert hub.requests == [], "weights/<name> is a path, never a Hub repo of an org called 'weights'"
    # With --weights-dir pointing at the folder, "weights/<name>" is found from anywhere.
    folder = download(hub, tmp_path / "project" / "weights")
    assert resolve_checkpoint("weights/tiny-qwen3", tmp_path / "project" / "weights") == folder


# --- every file is checked against the Hub's hash -------------------------------------------------------------


def test_tampered_shard_from_the_hub_is_fetched_again_and_loads_the_right_bytes(hub, source, tmp_path, caplog):
    shard = shards(source)[1]
    hub.tamper_once[shard] = True  # same size, one byte flipped: only the sha256 can tell
    folder = download(hub, tmp_path)
    assert (folder / shard).read_bytes() == (source / shard).read_bytes(), "the tampered bytes were kept"
    assert file_gets(hub).count(f"/{REPO}/resolve/{COMMIT}/{shard}") == 2, "fetched again exactly once"
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and shard in warnings[0] and "sha256" in warnings[0], warnings
    ours = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()
    for key, tensor in load_reference(source).state_dict().items():
        assert torch.equal(ours[key], tensor), f"{key} differs after the repaired download"


def test_tampered_small_file_from_the_hub_is_fetched_again(hub, source, tmp_path, caplog):
    hub.tamper_once["config.json"] = True  # not LFS: checked against its git blob id
    folder = download(hub, tmp_path)
    assert (folder / "config.json").read_bytes() == (source / "config.json").read_bytes()
    assert "config.json does not match the git blob id" in caplog.text


def test_a_hub_that_always_sends_tampered_bytes_is_one_error_and_nothing_is_kept(hub, source, tmp_path):
    shard = shards(source)[0]
    hub.tampered.add(shard)
    with pytest.raises(HubError, match=f"{shard} from .* does not match the sha256 .*, twice; discarded it"):
        download(hub, tmp_path)
    folder = tmp_path / "tiny-qwen3"
    assert not (folder / shard).exists(), "bytes that fail their hash never reach the folder"
    assert not any((folder / PARTIAL_DIR).iterdir()), "and are not kept as a partial file either"


def tamper(file: Path, keep_mtime: bool) -> None:
    """Flip one byte, same size; optionally put the mtime back, as a careful attacker (or a bad disk) would."""
    stat = file.stat()
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(data)
    if keep_mtime:
        os.utime(file, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def test_a_file_changed_since_it_was_hashed_is_never_up_to_date(hub, source, tmp_path, caplog):
    folder = download(hub, tmp_path)
    shard = folder / shards(folder)[0]
    tamper(shard, keep_mtime=False)
    before = len(file_gets(hub))
    download(hub, tmp_path)
    assert shard.read_bytes() == (source / shard.name).read_bytes()
    assert file_gets(hub)[before:] == [f"/{REPO}/resolve/{COMMIT}/{shard.name}"]
    assert f"{shard} does not match the sha256 the Hub lists; downloading it again" in caplog.text


def test_verify_hashes_every_file_again_and_refetches_what_differs(hub, source, tmp_path):
    folder = download(hub, tmp_path)
    shard = folder / shards(folder)[-1]
    tamper(shard, keep_mtime=True)  # size and mtime as recorded: only hashing again can tell
    before = len(file_gets(hub))
    assert download(hub, tmp_path, verify=True) == folder
    assert shard.read_bytes() == (source / shard.name).read_bytes()
    assert file_gets(hub)[before:] == [f"/{REPO}/resolve/{COMMIT}/{shard.name}"], "only the bad file is fetched"


def test_verify_on_a_downloaded_folder_checks_it_against_its_commit_or_offline_against_the_record(hub, tmp_path):
    folder = download(hub, tmp_path)
    shard = folder / shards(folder)[0]
    tamper(shard, keep_mtime=True)
    with pytest.raises(CheckpointError, match=f"{shard} does not match the hash recorded when it was downloaded"):
        resolve_checkpoint(str(folder), local_files_only=True, verify=True)
    before = len(hub.requests)
    assert resolve_checkpoint(str(folder), endpoint=hub.url, progress=False, verify=True) == folder
    assert hub.requests[before] == ("GET", f"/api/models/{REPO}/revision/{COMMIT}"), "asks for the recorded commit"
    resolve_checkpoint(str(folder), local_files_only=True, verify=True)  # repaired


def test_verify_on_a_folder_we_did_not_download_asks_for_the_hub_id(source):
    with pytest.raises(CheckpointError, match="has no record of the Hub repo it came from.*pass its Hub id"):
        resolve_checkpoint(str(source), verify=True)


def test_only_files_the_repo_lists_are_ever_replaced(hub, source, tmp_path):
    folder = tmp_path / "tiny-qwen3"
    folder.mkdir()
    mine = {  # a user's own files, some of them "damaged" safetensors
        "my-finetune.safetensors": b"\x10\x00",
        "adapter.safetensors": b"version https://git-lfs.github.com/spec/v1\noid sha256:abc\nsize 9\n",
        "lora.safetensors": (source / shards(source)[0]).read_bytes()[:-7],
        "notes.txt": b"mine",
    }
    for name, data in mine.items():
        (folder / name).write_bytes(data)
    (folder / shards(source)[0]).write_bytes(b"truncated")  # listed by the repo: this one is repaired
    download(hub, tmp_path)
    for name, data in mine.items():
        assert (folder / name).read_bytes() == data, f"{name} is not the repo's: it must not be touched"
    assert (folder / shards(source)[0]).read_bytes() == (source / shards(source)[0]).read_bytes()


def test_a_download_left_by_snapshot_download_is_hashed_so_a_tampered_file_is_fetched(hub, source, tmp_path):
    # huggingface_hub's own bookkeeping (.cache/huggingface/ in the folder) calls this shard up to date;
    # ours has no record of it, so it is hashed before it is trusted.
    folder = tmp_path / "tiny-qwen3"
    snapshot_download(REPO, local_dir=folder, endpoint=hub.url, tqdm_class=None)
    assert (folder / ".cache" / "huggingface").is_dir()
    shard = folder / shards(source)[0]
    tamper(shard, keep_mtime=True)
    before = len(file_gets(hub))
    assert download(hub, tmp_path) == folder
    assert shard.read_bytes() == (source / shard.name).read_bytes()
    assert file_gets(hub)[before:] == [f"/{REPO}/resolve/{COMMIT}/{shard.name}"], "only the tampered file"


@pytest.mark.parametrize(
    "field, value, named",
    [
        ("rfilename", "config\x1b[2J.json", "file name"),  # a terminal escape in a name
        ("size", -1, "size of"),
        ("size", "12", "size of"),
        ("blobId", "not-a-hash", "hash of"),
        ("lfs", {"size": 1, "sha256": "../../etc/passwd", "pointerSize": 1}, "hash of"),
    ],
)
def test_a_malformed_file_list_is_one_line_and_writes_nothing(hub, tmp_path, field, value, named):
    def edit(siblings):
        entry = next(s for s in siblings if s["rfilename"] == "config.json")
        entry[field] = value
        return siblings

    hub.edit_listing = edit
    with pytest.raises(HubError, match=f"sent a malformed file list for {REPO} .*{named}"):
        download(hub, tmp_path)
    assert file_gets(hub) == [] and not (tmp_path / "tiny-qwen3").exists(), "nothing fetched or written"


# --- a Hub that stalls or floods us ---------------------------------------------------------------------------

SHORT = DownloadLimits(min_bytes_per_second=10_000, grace_seconds=1.0, read_timeout=1.0)  # a deadline in ~1 s


@pytest.mark.parametrize("behaviour", ["trickle", "stall"])
def test_slow_server_hits_the_deadline_and_the_next_try_resumes(hub, source, tmp_path, behaviour):
    shard = shards(source)[0]
    # trickle: a byte every 50 ms, forever; stall: 10 bytes, then silence.
    hub.trickle[shard] = (1, 0.05) if behaviour == "trickle" else (10, 60)
    start = time.monotonic()
    with pytest.raises(HubError, match=f"{shard}: the Hub sent .* bytes in .* s, slower than the minimum of 10000"):
        download(hub, tmp_path, limits=SHORT)
    assert time.monotonic() - start < 10, "grace + bytes / rate, not forever"
    (partial,) = (tmp_path / "tiny-qwen3" / PARTIAL_DIR).glob(f"{shard}.*.incomplete")
    kept = partial.stat().st_size
    assert kept > 0, "what arrived is kept"
    hub.trickle.clear()
    folder = download(hub, tmp_path, limits=SHORT)
    assert (folder / shard).read_bytes() == (source / shard).read_bytes()
    assert hub.ranges[-1] == f"{shard}: bytes={kept}-", "the next try continues where the slow one stopped"


@pytest.mark.parametrize("behaviour", ["endless", "padded"])
def test_a_body_longer_than_the_listed_size_is_cut_and_discarded(hub, source, tmp_path, behaviour):
    shard = shards(source)[0]
    hub.endless.add(shard) if behaviour == "endless" else hub.padded.add(shard)
    start = time.monotonic()
    with pytest.raises(HubError, match=f"{shard} from .* (is longer than|would be) .*twice; discarded it"):
        download(hub, tmp_path)
    assert time.monotonic() - start < 10
    assert file_gets(hub).count(f"/{REPO}/resolve/{COMMIT}/{shard}") == 2, "discarded, fetched once more, given up"
    folder = tmp_path / "tiny-qwen3"
    biggest = max(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    assert biggest <= max(p.stat().st_size for p in source.iterdir() if p.is_file()), "disk use is bounded"
    assert not (folder / shard).exists()


def test_two_downloads_into_one_folder_both_succeed_and_fetch_each_file_once(hub, source, tmp_path, caplog):
    shard = shards(source)[0]
    hub.hold[shard] = threading.Event()  # the first download stops mid-shard, holding the folder's lock
    results = {}

    def run(name):
        try:
            results[name] = download(hub, tmp_path)
        except Exception as e:  # reported below, with the thread's name
            results[name] = e

    def wait_for(condition):
        for _ in range(500):
            if condition():
                return
            time.sleep(0.02)

    first = threading.Thread(target=run, args=("first",))
    first.start()
    wait_for(lambda: hub.sent.get(shard))
    second = threading.Thread(target=run, args=("second",))
    second.start()
    wait_for(lambda: "waiting for it" in caplog.text)
    hub.hold[shard].set()
    first.join(timeout=30)
    second.join(timeout=30)
    folder = tmp_path / "tiny-qwen3"
    assert results == {"first": folder, "second": folder}, results
    gets = file_gets(hub)
    assert len(gets) == len(set(gets)), f"a file was fetched twice: {gets}"
    assert "is writing into" in caplog.text and "waiting for it" in caplog.text, "the second says why it waits"
    for name in shards(source):
        assert (folder / name).read_bytes() == (source / name).read_bytes()


def test_a_download_that_holds_the_folder_too_long_is_reported_clearly(hub, tmp_path):
    lock = tmp_path / "tiny-qwen3" / ".cache" / "qwen3-scratch" / "lock"
    lock.parent.mkdir(parents=True)
    with open(lock, "w") as held:  # as another process in the middle of a download would
        held.write("4242")
        held.flush()
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(HubError, match=r"another download \(pid 4242\) has been writing into .*tiny-qwen3 for"):
            download(hub, tmp_path, limits=DownloadLimits(lock_timeout=0.3))
    assert file_gets(hub) == [], "nothing is fetched without the lock"


def test_ctrl_c_during_a_download_exits_at_once_with_one_line_and_leaves_it_resumable(hub, chat_source, tmp_path):
    shard = sorted(p.name for p in chat_source.glob("*.safetensors"))[0]
    hub.trickle[shard] = (1000, 0.05)  # 20 kB/s: ~20 s for the shard; Ctrl-C comes within the 30 s grace
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf"),
           "HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_HUB_OFFLINE": "0"}  # fmt: skip
    command = [sys.executable, "-m", "qwen3_scratch.generate", "--model", CHAT_REPO, "--weights-dir", tmp_path,
               "--prompt", "hi"]  # fmt: skip
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(1200):  # python and torch start up (seconds on a busy machine), then the shard arrives
            if hub.sent.get(shard, 0) >= 5000 or proc.poll() is not None:
                break
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        sent_at = time.monotonic()
        out, err = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert time.monotonic() - sent_at < 10, "Ctrl-C must not wait for the transfer in flight (it used to take ~35 s)"
    assert proc.returncode == 130, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "interrupted" in lines[0] and "Traceback" not in err, err
    (partial,) = (tmp_path / "tiny-chat" / PARTIAL_DIR).glob(f"{shard}.*.incomplete")
    kept = partial.stat().st_size
    assert kept > 0
    hub.trickle.clear()
    folder = resolve_checkpoint(CHAT_REPO, tmp_path, endpoint=hub.url, progress=False)
    assert (folder / shard).read_bytes() == (chat_source / shard).read_bytes()
    assert hub.ranges == [f"{shard}: bytes={kept}-"], "the next run continues the interrupted file"


# --- the command line: --revision, --verify, and bad input as one line ---------------------------------------


@pytest.fixture
def cli_hub(hub, monkeypatch):
    monkeypatch.setattr(constants, "ENDPOINT", hub.url)  # what the CLI uses when no endpoint is passed
    return hub


def test_cli_revision_downloads_that_commit(cli_hub, chat_source, tmp_path, capsys):
    v1 = tmp_path / "v1"
    shutil.copytree(chat_source, v1)
    config = json.loads((v1 / "config.json").read_text())
    (v1 / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 512}))
    cli_hub.revisions[CHAT_REPO, "v1"] = (V1_COMMIT, v1)
    code, out, err = cli(capsys, "--model", CHAT_REPO, "--weights-dir", tmp_path, "--revision", "v1",
                         "--prompt", "hi", "--max-new-tokens", "2", "--temperature", "0")  # fmt: skip
    assert code == 0, err
    folder = tmp_path / "tiny-chat"
    assert (folder / "config.json").read_bytes() == (v1 / "config.json").read_bytes()
    assert json.loads((folder / RECORD).read_text())["commit"] == V1_COMMIT
    assert all(f"/resolve/{V1_COMMIT}/" in path for path in file_gets(cli_hub)), "every file from that commit"
    code, out, err = cli(capsys, "--model", CHAT_REPO, "--weights-dir", tmp_path, "--revision", "v9",
                         "--prompt", "hi")  # fmt: skip
    assert_one_line_error(code, err, "no revision 'v9'")


def test_cli_verify_repairs_a_tampered_download(cli_hub, chat_source, tmp_path, capsys, caplog):
    args = ["--model", CHAT_REPO, "--weights-dir", tmp_path, "--prompt", "hi", "--max-new-tokens", "2"]
    assert cli(capsys, *args)[0] == 0
    shard = tmp_path / "tiny-chat" / sorted(p.name for p in chat_source.glob("*.safetensors"))[-1]
    tamper(shard, keep_mtime=True)
    code, out, err = cli(capsys, *args, "--verify")
    assert code == 0, err
    assert shard.read_bytes() == (chat_source / shard.name).read_bytes()
    assert f"{shard.name} does not match the sha256 the Hub lists; downloading it again" in caplog.text


@pytest.mark.parametrize("case", ["weights path elsewhere", "no config.json", "revision of a local folder"])
def test_cli_bad_model_folders_are_one_line(case, chat_source, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    if case == "weights path elsewhere":
        code, _, err = cli(capsys, "--model", "weights/tiny-chat", "--prompt", "hi")
        assert_one_line_error(code, err, f"looked for {tmp_path / 'weights' / 'tiny-chat'}")
    elif case == "no config.json":
        shutil.copytree(chat_source, tmp_path / "weights" / "tiny-chat")
        code, _, err = cli(capsys, "--model", tmp_path / "weights", "--prompt", "hi")
        assert_one_line_error(code, err, "is not a checkpoint folder: it has no config.json", "did you mean")
    else:
        code, _, err = cli(capsys, "--model", chat_source, "--revision", "v1", "--prompt", "hi")
        assert_one_line_error(code, err, "--revision v1 needs a Hub id")
