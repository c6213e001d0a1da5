"""One file from the Hub onto disk, trusting the server for nothing but what its metadata promised.

`snapshot.py` decides which files to fetch; this module fetches one of them:

- the body may not be longer than the size the Hub lists, so an endless body is cut and never fills the disk;
- every byte received buys `1 / min_bytes_per_second` seconds on top of a grace period, so a server that
  sends a byte every few seconds fails in bounded time (at most grace + size / rate for the whole file);
- the bytes must hash to the sha256 the Hub lists (LFS files) or to the git blob id (small files) before
  they replace anything in the folder; a file that fails is discarded and fetched once more;
- bytes land in `.cache/qwen3-scratch/download/<name>.<oid>.incomplete` first, so Ctrl-C or a dropped
  connection leaves a partial file that the next try continues with a Range request.

Files are fetched one at a time, in the caller's thread: Ctrl-C then interrupts the read in progress at
once (a thread pool waits for every file in flight), and Qwen3's small models are a single file anyway.
"""

import contextlib
import glob
import hashlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import constants  # huggingface_hub.utils (~0.1 s of imports) only once the Hub is asked

from qwen3_scratch.errors import HubError

log = logging.getLogger(__name__)

PARTIAL_DIR = Path(".cache") / "qwen3-scratch" / "download"
HASH_BLOCK = 2**20  # bytes read at a time when hashing a file on disk: memory stays bounded
ERROR_BODY_BYTES = 2**16  # the most of an error page we read to explain it


@dataclass(frozen=True)
class DownloadLimits:
    """What one download may cost before it is abandoned with a one-line HubError."""

    min_bytes_per_second: float = 20_000  # the average a transfer must keep up once the grace period is over
    grace_seconds: float = 30.0  # free time per file: connecting, TLS, redirects, a slow start
    read_timeout: float | None = None  # longest silence; None: HF_HUB_DOWNLOAD_TIMEOUT (HF_HUB_ETAG_TIMEOUT for lists)
    retries: int = 3  # reconnections (continuing with a Range request) after a dropped connection
    metadata_bytes: int = 32 * 2**20  # the most a repo's file list may weigh
    lock_timeout: float = 3600.0  # how long to wait for another download into the same folder


@dataclass(frozen=True)
class RemoteFile:
    """A file as the Hub's metadata lists it: what its bytes must be."""

    name: str
    size: int
    sha256: str | None = None  # LFS files (weights, big tokenizers): sha256 of the content
    blob_id: str | None = None  # other files: git's blob id, sha1 of b"blob <size>\0" + content

    @property
    def oid(self) -> str:
        return self.sha256 or self.blob_id or f"size-{self.size}"

    @property
    def hash_name(self) -> str:
        return "sha256" if self.sha256 else "git blob id" if self.blob_id else "size"

    def hasher(self):
        """A hashlib object that, fed the content, gives `oid`; None when the Hub lists no hash."""
        if self.sha256:
            return hashlib.sha256()
        if self.blob_id:
            h = hashlib.sha1()
            h.update(b"blob %d\0" % self.size)
            return h
        return None


class Mismatch(Exception):
    """The bytes received are not the file the metadata describes; `problem` reads after the file name."""

    def __init__(self, problem: str):
        self.problem = problem
        super().__init__(problem)


def matches(path: Path, remote: RemoteFile) -> bool:
    """Whether the file on disk is `remote`, byte for byte: its size, then its hash (about 1 s per GB)."""
    if not path.is_file() or path.stat().st_size != remote.size:
        return False
    hasher = remote.hasher()
    if hasher is None:
        return True
    with open(path, "rb") as f:
        while block := f.read(HASH_BLOCK):
            hasher.update(block)
    return hasher.hexdigest() == remote.oid


def fetch_file(session, url: str, remote: RemoteFile, folder: Path, limits: DownloadLimits, *, headers, progress):
    """Download `remote` into `folder`, checked against its metadata; a file that fails is fetched once more."""
    partial = folder / PARTIAL_DIR / f"{remote.name}.{remote.oid[:16]}.incomplete"
    partial.parent.mkdir(parents=True, exist_ok=True)
    for stale in partial.parent.glob(f"{glob.escape(remote.name)}.*.incomplete"):
        if stale != partial:  # left by an interrupted download of another version of the file
            stale.unlink()
    for attempt in (1, 2):
        try:
            _Transfer(session, url, remote, partial, limits, headers, progress).run()
        except Mismatch as e:
            partial.unlink(missing_ok=True)  # ours, never the user's: it lives in our cache folder
            if attempt == 2:
                raise HubError(f"{remote.name} from {url} {e.problem}, twice; discarded it: try again later") from e
            log.warning("%s %s; discarded it, downloading it again", remote.name, e.problem)
            continue
        partial.replace(folder / remote.name)
        return


class _Transfer:
    """One file's bytes into `partial`: resumed, reconnected after a drop, cut at the listed size, hashed."""

    def __init__(self, session, url, remote: RemoteFile, partial: Path, limits: DownloadLimits, headers, progress):
        self.session, self.url, self.remote, self.partial, self.headers = session, url, remote, partial, headers
        self.limits, self.progress = limits, progress
        self.deadline = _Deadline(remote.name, remote.size, limits, limits.read_timeout)
        self.have = partial.stat().st_size if partial.is_file() else 0
        if self.have > remote.size:
            self.have = 0
        self.hasher = _hash_prefix(partial, self.have, remote)  # resuming must hash what is already there

    def run(self) -> None:
        from huggingface_hub.utils import tqdm as ProgressBar

        with ProgressBar(total=self.remote.size, initial=self.have, unit="B", unit_scale=True, unit_divisor=1024,
                         desc=self.remote.name, disable=not self.progress) as self.bar:  # fmt: skip
            for reconnect in range(self.limits.retries + 1):
                if self.have == self.remote.size:
                    break
                self.deadline.check(self.have)
                try:
                    self._receive()
                except Exception as e:
                    if not is_transport_error(e) or reconnect == self.limits.retries:
                        raise
                    log.info("%s: connection lost after %d bytes (%s); continuing", self.remote.name, self.have, e)
        if self.have < self.remote.size:
            raise HubError(f"{self.remote.name}: the Hub kept closing the connection ({self.have} of "
                           f"{self.remote.size} bytes); try again later")  # fmt: skip
        if self.hasher is not None and self.hasher.hexdigest() != self.remote.oid:
            raise Mismatch(f"does not match the {self.remote.hash_name} the Hub lists ({self.remote.oid[:12]}...)")

    def _receive(self) -> None:
        """One connection: append what the server sends after byte `have`."""
        size = self.remote.size
        asked = {**self.headers, "Accept-Encoding": "identity"}
        if self.have:
            asked["Range"] = f"bytes={self.have}-"
        with _stream(self.session, self.url, asked, self.deadline.read_timeout()) as response:
            if self.have and response.status_code != 206:  # the server ignored the Range: start over
                self.have, self.hasher = 0, self.remote.hasher()
                self.bar.reset(total=size)
            length = response.headers.get("Content-Length", "")
            if length.isdigit() and self.have + int(length) > size:
                raise Mismatch(f"would be {self.have + int(length)} bytes by the server's count, not {size}")
            with open(self.partial, "ab" if self.have else "wb") as out:
                for piece in response.iter_raw():
                    if self.have + len(piece) > size:
                        raise Mismatch(f"is longer than the {size} bytes the Hub lists; cut it there")
                    out.write(piece)
                    if self.hasher is not None:
                        self.hasher.update(piece)
                    self.have += len(piece)
                    self.deadline.received += len(piece)
                    self.bar.update(len(piece))
                    self.deadline.check(self.have)


def fetch_json(session, url: str, limits: DownloadLimits, *, headers) -> object:
    """A small JSON document (a repo's file list), under the same kind of deadline and a size cap."""
    deadline = _Deadline(url, None, limits, limits.read_timeout or constants.HF_HUB_ETAG_TIMEOUT)
    body = bytearray()
    with _stream(session, url, headers, deadline.read_timeout()) as response:
        for piece in response.iter_raw():
            body += piece
            if len(body) > limits.metadata_bytes:
                raise HubError(f"{url} sent more than {limits.metadata_bytes} bytes for a file list; try again later")
            deadline.received = len(body)
            deadline.check(len(body))
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as e:
        raise HubError(f"{url} did not answer with a JSON file list; check the endpoint (HF_ENDPOINT)") from e


@contextlib.contextmanager
def _stream(session, url, headers, timeout):
    """A streamed GET that has raised huggingface_hub's error for any 4xx/5xx, reading a bounded error page."""
    from huggingface_hub.utils import HfHubHTTPError, hf_raise_for_status

    with session.stream("GET", url, headers=headers, timeout=timeout, follow_redirects=True) as response:
        if response.status_code >= 400:
            page = b""
            for piece in response.iter_raw():
                page += piece
                if len(page) > ERROR_BODY_BYTES:
                    break
            # huggingface_hub reads the error's JSON to name it (gated, not found...): give it the bounded page.
            hf_raise_for_status(type(response)(response.status_code, headers=response.headers,
                                               content=page[:ERROR_BODY_BYTES], request=response.request))  # fmt: skip
            raise HfHubHTTPError(f"HTTP {response.status_code} for {url}", response=response)
        yield response


class _Deadline:
    """A grace period, plus 1 / min_bytes_per_second seconds for every byte received: running out is a stall.

    So a file gets at most grace + size / rate seconds in all, and a server that trickles fails soon after
    the grace period, however big the file.
    """

    def __init__(self, name: str, size: int | None, limits: DownloadLimits, silence: float | None):
        self.name, self.size, self.limits, self.start = name, size, limits, time.monotonic()
        self.received = 0  # bytes received by this transfer (not those already on disk)
        self.silence = silence or constants.HF_HUB_DOWNLOAD_TIMEOUT

    def left(self) -> float:
        allowed = self.limits.grace_seconds + self.received / self.limits.min_bytes_per_second
        return allowed - (time.monotonic() - self.start)

    def check(self, have: int) -> None:
        if self.left() < 0:
            of = f" of {self.size}" if self.size is not None else ""
            raise HubError(
                f"{self.name}: the Hub sent {have}{of} bytes in {time.monotonic() - self.start:.1f} s, "
                f"slower than the minimum of {self.limits.min_bytes_per_second:.0f} bytes/s; what arrived is kept "
                "for the next try: check the network, or try again later"
            )

    def read_timeout(self) -> float:
        """The longest wait for the next bytes: the silence allowed, but not much past the deadline."""
        return max(min(self.silence, self.left() + 0.5), 0.1)


def _hash_prefix(partial: Path, have: int, remote: RemoteFile):
    """A hasher already fed the first `have` bytes of a partial file."""
    hasher = remote.hasher()
    if hasher is not None and have:
        with open(partial, "rb") as f:
            while have > 0 and (block := f.read(min(HASH_BLOCK, have))):
                hasher.update(block)
                have -= len(block)
    return hasher


def is_transport_error(error: BaseException) -> bool:
    """A connection that failed, dropped or timed out, whichever HTTP library this huggingface_hub uses.

    huggingface_hub 2.x raises httpx2's errors, 1.x httpx's; they share no base class with the builtins,
    so they are recognised by their library. HTTP status errors arrive as HfHubHTTPError.
    """
    from huggingface_hub.utils import HfHubHTTPError

    if isinstance(error, HfHubHTTPError) or type(error).__name__ == "HTTPStatusError":
        return False  # the server answered
    library = type(error).__module__.split(".")[0]
    return isinstance(error, (ConnectionError, TimeoutError)) or library in {"httpx", "httpx2", "requests", "urllib3"}
