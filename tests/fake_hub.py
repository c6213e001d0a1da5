"""A fake Hugging Face Hub on 127.0.0.1, for testing downloads without the network.

It serves folders through the few endpoints huggingface_hub's `snapshot_download` calls (model info,
tree listing, /resolve/ with HEAD, GET and Range) and records every request, so tests can say exactly
what was fetched. Nothing here reaches the real Hub.
"""

import contextlib
import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

from huggingface_hub import constants

COMMIT = "0123456789abcdef0123456789abcdef01234567"
GATED = "fake-org/gated-qwen3"


class FakeHub(BaseHTTPRequestHandler):
    """Model info, tree listing and /resolve/ (HEAD, GET, Range) for the repos in `self.server.repos`."""

    def log_message(self, *args):  # keep pytest's output clean
        pass

    def do_HEAD(self):
        self._answer(body=False)

    def do_GET(self):
        self._answer(body=True)

    def _answer(self, body):
        path = unquote(urlsplit(self.path).path)
        self.server.requests.append((self.command, path))
        # Model info is /api/models/{repo} (default branch) or .../revision/{rev}; the listing is .../tree/{rev}.
        if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/(revision|tree)/([^/]+))?", path):
            repo, endpoint, revision = m.groups()
            if self._repo_and_revision_exist(repo, revision or "main"):
                listing = self._tree(repo) if endpoint == "tree" else {"id": repo, "sha": COMMIT}
                self._send(200, {"Content-Type": "application/json"}, json.dumps(listing).encode(), body)
        elif m := re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path):
            repo, revision, filename = m.groups()
            if self._repo_and_revision_exist(repo, revision):
                self._send_file(repo, filename, body)
        else:
            self._send(404, {}, b"", body)

    def _repo_and_revision_exist(self, repo, revision):
        if repo not in self.server.repos:
            self._send(404, {"X-Error-Code": "RepoNotFound"}, b"", body=False)
        elif revision not in ("main", COMMIT):
            self._send(404, {"X-Error-Code": "RevisionNotFound"}, b"", body=False)
        else:
            return True
        return False

    def _tree(self, repo):
        folder = self.server.repos[repo]
        files = sorted(p for p in folder.rglob("*") if p.is_file())
        return [
            {"type": "file", "path": p.relative_to(folder).as_posix(), "size": p.stat().st_size, "oid": "0" * 40}
            for p in files
        ]

    def _send_file(self, repo, filename, body):
        if repo == GATED:  # the real Hub lists a gated repo's files but refuses to serve them
            return self._send(401, {"X-Error-Code": "GatedRepo"}, b"", body=False)
        file = self.server.repos[repo] / filename
        if not file.is_file():
            return self._send(404, {"X-Error-Code": "EntryNotFound"}, b"", body=False)
        data = file.read_bytes()
        if self.command == "GET" and filename in self.server.cut_once:  # the connection drops mid-file
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data[: self.server.cut_once.pop(filename)])
            return
        headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{hashlib.sha256(data).hexdigest()}"', "Accept-Ranges": "bytes"}
        start = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range", ""))
        if start:  # huggingface_hub resumes a broken transfer with "Range: bytes=N-"
            self.server.ranges.append(f"{filename}: {start.group(0)}")
            first = int(start.group(1))
            headers["Content-Range"] = f"bytes {first}-{len(data) - 1}/{len(data)}"
            return self._send(206, headers, data[first:], body)
        self._send(200, headers, data, body)

    def _send(self, status, headers, data, body):
        self.send_response(status)
        for key, value in {**headers, "Content-Length": str(len(data))}.items():
            self.send_header(key, value)
        self.end_headers()
        if body:
            self.wfile.write(data)


class FakeHubServer(ThreadingHTTPServer):
    daemon_threads = True
    # snapshot_download opens 8 connections at once; the default backlog of 5 drops some, and the kernel
    # retries them only after a second.
    request_queue_size = 64


@contextlib.contextmanager
def serve_fake_hub(repos: dict):
    """A running fake Hub serving {repo_id: folder}; `hub.url` is its endpoint, `hub.requests` what it got."""
    server = FakeHubServer(("127.0.0.1", 0), FakeHub)
    server.repos = dict(repos)
    server.requests = []
    server.cut_once = {}  # filename -> bytes sent before the connection drops, once
    server.ranges = []
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
