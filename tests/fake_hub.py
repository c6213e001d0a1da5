"""A fake Hugging Face Hub on 127.0.0.1, for testing downloads without the network.

It serves folders through the endpoints a download calls (model info with the file list, sizes and hashes;
/resolve/ with HEAD, GET and Range) and records every request, so tests can say exactly what was fetched.
It can also misbehave on purpose, file by file: cut a transfer, send tampered bytes, trickle, or never end.
Nothing here reaches the real Hub.
"""

import contextlib
import functools
import hashlib
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

from huggingface_hub import constants

COMMIT = "0123456789abcdef0123456789abcdef01234567"
GATED = "fake-org/gated-qwen3"
LFS_SUFFIXES = {".safetensors", ".bin", ".pth"}
LFS_MIN_SIZE = 2**20  # the Hub stores big files in LFS whatever their type (Qwen's tokenizer.json is)


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def is_lfs(path: Path) -> bool:
    return path.suffix in LFS_SUFFIXES or path.stat().st_size >= LFS_MIN_SIZE


def digests(path: Path) -> dict:
    """The Hub's metadata for one file: size, git blob id, and for an LFS file its sha256."""
    stat = path.stat()
    return _digests(path, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=256)
def _digests(path: Path, size: int, mtime_ns: int) -> dict:  # hashed once per version of a file
    data = path.read_bytes()
    entry = {"size": size, "blobId": git_blob_id(data)}
    if is_lfs(path):
        entry["lfs"] = {"size": size, "sha256": hashlib.sha256(data).hexdigest(), "pointerSize": 134}
    return entry


class FakeHub(BaseHTTPRequestHandler):
    """Model info and /resolve/ (HEAD, GET, Range) for the repos in `self.server.repos`."""

    def log_message(self, *args):  # keep pytest's output clean
        pass

    def do_HEAD(self):
        self._answer(body=False)

    def do_GET(self):
        self._answer(body=True)

    def _answer(self, body):
        url = urlsplit(self.path)
        path = unquote(url.path)
        self.server.requests.append((self.command, path))
        # Model info is /api/models/{repo} (default branch) or .../revision/{rev}; the listing is .../tree/{rev}.
        if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/(revision|tree)/([^/]+))?", path):
            repo, endpoint, revision = m.groups()
            if snapshot := self._snapshot(repo, revision or "main"):
                commit, folder = snapshot
                if endpoint == "tree":  # huggingface_hub's snapshot_download lists files here
                    listing = [{"type": "file", "path": f["rfilename"], "size": f["size"], "oid": f["blobId"]}
                               for f in self._files(folder, blobs=True)]  # fmt: skip
                else:
                    blobs = parse_qs(url.query).get("blobs") == ["true"]
                    siblings = self.server.edit_listing(self._files(folder, blobs))
                    listing = {"id": repo, "sha": commit, "siblings": siblings}
                self._send(200, {"Content-Type": "application/json"}, json.dumps(listing).encode(), body)
        elif m := re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path):
            repo, revision, filename = m.groups()
            if snapshot := self._snapshot(repo, revision):
                self._send_file(repo, snapshot[1], filename, body)
        else:
            self._send(404, {}, b"", body)

    def _snapshot(self, repo, revision):
        """(commit, folder) for a branch, tag or commit of `repo`, or None after answering 404."""
        if repo not in self.server.repos:
            self._send(404, {"X-Error-Code": "RepoNotFound"}, b"", body=False)
        elif revision in ("main", COMMIT):
            return COMMIT, self.server.repos[repo]
        elif (repo, revision) in self.server.revisions:
            return self.server.revisions[repo, revision]
        elif commits := [s for (r, _), s in self.server.revisions.items() if r == repo and s[0] == revision]:
            return commits[0]
        else:
            self._send(404, {"X-Error-Code": "RevisionNotFound"}, b"", body=False)
        return None

    def _files(self, folder, blobs):
        """The siblings list; with blobs=true, each file's size and git blob id, and an LFS file's sha256."""
        siblings = []
        for p in sorted(p for p in folder.rglob("*") if p.is_file()):
            entry = {"rfilename": p.relative_to(folder).as_posix()}
            if blobs:
                entry.update(digests(p))
            siblings.append(entry)
        return siblings

    def _send_file(self, repo, folder, filename, body):
        server = self.server
        if repo == GATED:  # the real Hub lists a gated repo's files but refuses to serve them
            return self._send(401, {"X-Error-Code": "GatedRepo"}, b"", body=False)
        file = folder / filename
        if not file.is_file():
            return self._send(404, {"X-Error-Code": "EntryNotFound"}, b"", body=False)
        data, meta = file.read_bytes(), digests(file)
        oid = meta["lfs"]["sha256"] if "lfs" in meta else meta["blobId"]
        headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{oid}"', "Accept-Ranges": "bytes"}
        if self.command != "GET":
            return self._send(200, headers, data, body=False)
        if filename in server.tampered or server.tamper_once.pop(filename, False):  # same size, other bytes
            data = bytearray(data)
            data[len(data) // 2] ^= 0xFF
            data = bytes(data)
        if filename in server.padded:  # more bytes than listed, announced in Content-Length
            data += b"\0" * 1000
        if filename in server.endless:  # no Content-Length, and a body that never ends
            self.send_response(200)
            self.end_headers()
            while True:
                self.wfile.write(b"\0" * 65536)
        status, first = 200, 0
        # a client resumes a broken transfer with "Range: bytes=N-"
        if start := re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range", "")):
            server.ranges.append(f"{filename}: {start.group(0)}")
        if start and not server.ignore_ranges:
            status, first = 206, int(start.group(1))
            headers["Content-Range"] = f"bytes {first}-{len(data) - 1}/{len(data)}"
        data = data[first:]
        self.send_response(status)
        for key, value in {**headers, "Content-Length": str(len(data))}.items():
            self.send_header(key, value)
        self.end_headers()
        if filename in server.cut_once:  # the connection drops mid-file
            data = data[: server.cut_once.pop(filename)]
        if filename in server.hold:  # half the file, then wait until the test lets it go on
            self.wfile.write(data[: len(data) // 2])
            self.wfile.flush()
            server.sent[filename] = len(data) // 2
            server.hold[filename].wait(timeout=10)
            data = data[len(data) // 2 :]
        step, pause = server.trickle.get(filename, (len(data), 0))
        for i in range(0, len(data), max(step, 1)):
            self.wfile.write(data[i : i + step])
            self.wfile.flush()
            server.sent[filename] = server.sent.get(filename, 0) + len(data[i : i + step])
            time.sleep(pause)

    def _send(self, status, headers, data, body):
        self.send_response(status)
        for key, value in {**headers, "Content-Length": str(len(data))}.items():
            self.send_header(key, value)
        self.end_headers()
        if body:
            self.wfile.write(data)


class FakeHubServer(ThreadingHTTPServer):
    daemon_threads = True
    # A client may open several connections at once; the default backlog of 5 drops some, and the kernel
    # retries them only after a second.
    request_queue_size = 64

    def handle_error(self, request, client_address):
        pass  # a client that hangs up on a trickling or endless body is the point of those tests


@contextlib.contextmanager
def serve_fake_hub(repos: dict):
    """A running fake Hub serving {repo_id: folder}; `hub.url` is its endpoint, `hub.requests` what it got."""
    server = FakeHubServer(("127.0.0.1", 0), FakeHub)
    server.repos = dict(repos)
    server.revisions = {}  # (repo, branch or tag) -> (commit, folder): revisions other than main
    server.requests = []
    server.cut_once = {}  # filename -> bytes sent before the connection drops, once
    server.tamper_once = {}  # filename -> True: the next GET sends other bytes of the same size
    server.tampered = set()  # filenames whose every GET sends other bytes of the same size
    server.trickle = {}  # filename -> (bytes per write, seconds between writes)
    server.endless = set()  # filenames whose body never ends
    server.padded = set()  # filenames served with 1000 bytes more than the listing says
    server.hold = {}  # filename -> threading.Event: send half the file, then wait for the event
    server.sent = {}  # filename -> body bytes sent so far (trickled or held files)
    server.ranges = []
    server.ignore_ranges = False  # True: answer a Range request with the whole file (200), as some mirrors do
    server.edit_listing = lambda siblings: siblings  # a test may swap in a hostile file list
    server.url = f"http://127.0.0.1:{server.server_address[1]}"
    # A short poll interval so that shutdown() returns at once rather than after the default 0.5 s.
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def make_hf_hermetic(tmp_path, monkeypatch):
    """Keep huggingface_hub away from the user's cache, token and offline setting (read once at import)."""
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
