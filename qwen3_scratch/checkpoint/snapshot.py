"""A folder kept equal to one commit of a Hub repo: the file list, what was verified when, and the lock.

One request asks the Hub for the repo's files with their sizes and hashes; each file we want that is
missing or differs is fetched by `download.py`, which checks it before it replaces anything. So:

- only the files the model needs (no `original/` Meta weights, no `pytorch_model.bin` duplicates), and only
  files the repo lists are ever replaced: a user's own `*.safetensors` beside them are never touched;
- a file counts as up to date only if we hashed it and its size and mtime have not changed since
  (`.cache/qwen3-scratch/files.json`); `verify=True` hashes every file again (about 1 s per GB);
- one download into a folder at a time (`.cache/qwen3-scratch/lock`): a second one waits, then finds the
  files there.
"""

import contextlib
import json
import logging
import os
import re
import time
from pathlib import Path
from urllib.parse import quote

from qwen3_scratch.errors import CheckpointError, HubError

from .download import DownloadLimits, RemoteFile, fetch_file, fetch_json, matches

try:
    import fcntl
except ImportError:  # Windows: no folder lock
    fcntl = None

log = logging.getLogger(__name__)


# Everything the model, tokenizer and chat template read, plus the licence and model card that travel with the
# weights. Qwen repos also ship things we never read (Meta-format `original/`, onnx/, gguf, pytorch_model.bin);
# patterns are fnmatch-style, where `*` also matches `/`, so subfolders are excluded explicitly.
ALLOW_PATTERNS = [
    "*.json",
    "*.safetensors",
    "merges.txt",
    "vocab.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "LICENSE",
    "README.md",
]
IGNORE_PATTERNS = ["*/*"]


# A git blob id (sha1) or an LFS sha256.
SHA = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")

# What we know about a downloaded folder: where it came from, and which files were hashed when.
RECORD = Path(".cache") / "qwen3-scratch" / "files.json"
LOCK = Path(".cache") / "qwen3-scratch" / "lock"


def sync_folder(repo_id: str, revision, folder: Path, *, endpoint: str, verify: bool, limits: DownloadLimits,
                progress: bool) -> None:  # fmt: skip
    """Make `folder` hold the files we want from `repo_id` at `revision`, each matching the Hub's hash."""
    from huggingface_hub.utils import build_hf_headers, get_session  # ~0.1 s of imports: only when the Hub is asked

    session, headers = get_session(), build_hf_headers()
    commit, files = list_files(session, endpoint, repo_id, revision, limits, headers)
    folder.mkdir(parents=True, exist_ok=True)
    with folder_lock(folder, limits.lock_timeout):
        known = read_record(folder)["files"]
        record = {"repo_id": repo_id, "commit": commit, "files": {}}
        for remote in files:
            path = folder / remote.name
            if verify or not _unchanged_since_hashed(path, remote, known.get(remote.name)):
                if not _already_there(path, remote):
                    url = f"{endpoint}/{repo_id}/resolve/{quote(commit, safe='')}/{quote(remote.name)}"
                    fetch_file(session, url, remote, folder, limits, headers=headers, progress=progress)
            _remember(record, folder, path, remote)


def check_against_record(folder: Path, hint: str) -> None:
    """Offline `verify`: hash every file we downloaded and compare with what the Hub listed then."""
    for name, entry in read_record(folder)["files"].items():
        try:
            remote = remote_file(name, entry)
        except (ValueError, AttributeError):
            raise CheckpointError(f"{folder / RECORD} is damaged; {hint}") from None
        if not matches(folder / name, remote):
            raise CheckpointError(f"{folder / name} does not match the hash recorded when it was downloaded; {hint}")


def list_files(session, endpoint, repo_id, revision, limits, headers) -> tuple[str, list[RemoteFile]]:
    """The commit `revision` is, and the files we want from it with their sizes and hashes (one request).

    The commit pins every file to the same version, even if the branch moves during the download.
    """
    url = f"{endpoint}/api/models/{repo_id}" + (f"/revision/{quote(revision, safe='')}" if revision else "")
    info = fetch_json(session, url + "?blobs=true", limits, headers=headers)
    try:
        commit = info.get("sha") or revision or "main"
        listed = {s["rfilename"]: s for s in info["siblings"]}
        from huggingface_hub.utils import filter_repo_objects

        wanted = filter_repo_objects(list(listed), allow_patterns=ALLOW_PATTERNS, ignore_patterns=IGNORE_PATTERNS)
        files = [remote_file(name, listed[name]) for name in wanted]
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise HubError(f"{url} sent a malformed file list for {repo_id} ({e!r:.80}); try again later") from e
    return commit, files


def remote_file(name, entry: dict) -> RemoteFile:
    """A file-list entry (the Hub's, or our record's), checked: a plain name, a size, well-formed hashes."""
    lfs = entry.get("lfs") or {}
    sha256, blob_id = entry.get("sha256", lfs.get("sha256")), entry.get("blob_id", entry.get("blobId"))
    size = entry.get("size", lfs.get("size"))
    if not isinstance(name, str) or name in (".", "..") or Path(name).name != name or not name.isprintable():
        raise ValueError(f"file name {name!r}")
    if type(size) is not int or size < 0:
        raise ValueError(f"size of {name}: {size!r}")
    for oid in (sha256, blob_id):
        if oid is not None and not (isinstance(oid, str) and SHA.fullmatch(oid)):
            raise ValueError(f"hash of {name}: {oid!r:.80}")
    return RemoteFile(name, size, sha256, None if sha256 else blob_id)


def _unchanged_since_hashed(path: Path, remote: RemoteFile, entry: dict | None) -> bool:
    """Whether `path` is the file we hashed and found to be `remote`, untouched since (same size and mtime)."""
    return path.is_file() and entry == _entry(path, remote)


def _already_there(path: Path, remote: RemoteFile) -> bool:
    """Whether a file we have not hashed (or that changed since) is the Hub's after all; if not, say why."""
    if path.is_dir():
        raise CheckpointError(f"{path} is a folder where the repo has a file: move it away and try again")
    if not path.exists():
        return False
    if matches(path, remote):
        return True
    size = path.stat().st_size
    differs = f"does not match the {remote.hash_name}"
    if size != remote.size:
        differs = f"is {size} bytes, not the {remote.size}"
    log.warning("%s %s the Hub lists; downloading it again", path, differs)
    return False


def read_record(folder: Path) -> dict:
    """{"repo_id", "commit", "files": {name: {"size", "sha256", "blob_id", "mtime_ns"}}} for a folder we synced."""
    try:
        record = json.loads((folder / RECORD).read_text())
    except (OSError, ValueError, RecursionError):
        record = None
    if not isinstance(record, dict) or not isinstance(record.get("files"), dict):
        return {"files": {}}  # none, or unreadable: every file is hashed again, nothing worse
    return record


def _entry(path: Path, remote: RemoteFile) -> dict:
    """What we note about a verified file; the mtime tells us later whether anything has written to it since."""
    mtime_ns = path.stat().st_mtime_ns
    return {"size": remote.size, "sha256": remote.sha256, "blob_id": remote.blob_id, "mtime_ns": mtime_ns}


def _remember(record: dict, folder: Path, path: Path, remote: RemoteFile) -> None:
    """Note `path` as verified, and write the record at once (atomically), so Ctrl-C keeps what was done."""
    record["files"][remote.name] = _entry(path, remote)
    file = folder / RECORD
    file.parent.mkdir(parents=True, exist_ok=True)
    file.with_suffix(".tmp").write_text(json.dumps(record, indent=1))
    file.with_suffix(".tmp").replace(file)


@contextlib.contextmanager
def folder_lock(folder: Path, timeout: float):
    """Hold the folder's lock file; a second download waits (saying so once) rather than racing the first."""
    lock = folder / LOCK
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a+") as f:
        start, told = time.monotonic(), False
        while fcntl is not None:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                f.seek(0)
                holder = f.read().strip()[:20] or "?"
                if time.monotonic() - start > timeout:
                    raise HubError(f"another download (pid {holder}) has been writing into {folder} for over "
                                   f"{timeout:.0f} s; wait for it or stop it, then try again") from None  # fmt: skip
                if not told:
                    log.warning("another download (pid %s) is writing into %s; waiting for it", holder, folder)
                    told = True
                time.sleep(0.1)
        f.truncate(0)
        f.write(str(os.getpid()))
        f.flush()
        yield  # closing the file releases the lock, also if this process dies
