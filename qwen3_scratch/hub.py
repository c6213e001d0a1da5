"""Turn `--model` into a checkpoint folder: a local folder as it is, or a Hub id downloaded into weights/<name>.

The download is huggingface_hub's `snapshot_download` into a plain folder (`local_dir`), so the files a
learner opens are the Hub's files under their Hub names, not symlinks into a cache. What this module adds:

- only the files the model needs (no `original/` Meta weights, no `pytorch_model.bin` duplicates);
- a check that the folder is complete before anyone loads it (`verify_checkpoint`), because
  huggingface_hub happily returns a folder left half-done by an earlier failed try;
- one-line errors that name the model and say what to do, instead of huggingface_hub's tracebacks.
"""

import errno
import logging
import re
from pathlib import Path

import huggingface_hub
from huggingface_hub import HfApi, constants, snapshot_download
from huggingface_hub.utils import (
    GatedRepoError,
    HfHubHTTPError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import tqdm as HubProgressBar

from .errors import CheckpointError, HubError
from .weights import INDEX_FILE, DamagedFile, checkpoint_files, read_raw_header

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


# "org/name" with the characters the Hub allows.
HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")

REPAIR_HINT = "re-run the download to fetch it again (or delete the folder and download it afresh)"

# Errors on our side of the disk: worth one clear line, unlike a bug that raises OSError.
DISK_ERRNOS = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC), errno.EACCES, errno.EPERM, errno.EROFS}


def resolve_checkpoint(
    model: str,
    weights_dir="weights",
    *,
    revision: str | None = None,
    local_files_only: bool = False,
    endpoint: str | None = None,
    progress: bool = True,
) -> Path:
    """Return a verified checkpoint folder for `model`: an existing local folder, or a Hub id ("org/name").

    A Hub id is downloaded into `weights_dir/<name>`; files already there and up to date are not fetched
    again. `local_files_only` (or HF_HUB_OFFLINE in the environment) never touches the network.
    `endpoint` is the Hub's URL (default: huggingface.co, or HF_ENDPOINT).
    """
    local = Path(model).expanduser()
    if local.is_dir():
        return verify_checkpoint(local)
    if _looks_like_path(model) or not HUB_ID.fullmatch(model):
        raise CheckpointError(
            f"no checkpoint folder at {model}: pass an existing folder, or a Hub id such as Qwen/Qwen3-0.6B"
        )
    folder = Path(weights_dir).expanduser() / model.split("/")[1]
    if local_files_only:
        return _use_downloaded(model, folder, "run without --local-files-only")
    if huggingface_hub.is_offline_mode():
        return _use_downloaded(model, folder, "HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is set: unset it")
    return _download(model, folder, revision, endpoint, progress)


def verify_checkpoint(folder, *, hint: str = REPAIR_HINT) -> Path:
    """Check that `folder` holds config.json and every weight file it needs, whole; return it as a Path.

    Cheap on purpose (it reads only file headers): whether the tensors fit the config is the loader's job.
    `hint` ends each error message with what the user should do.
    """
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise CheckpointError(f"{folder / 'config.json'} is missing; {hint}")
    for file in checkpoint_files(folder):
        try:
            read_raw_header(file)
        except DamagedFile as e:
            where = f" (named in {INDEX_FILE})" if (folder / INDEX_FILE).is_file() else ""
            raise CheckpointError(f"{file} {e.problem}{where}; {hint}") from e
    return folder


def _looks_like_path(model: str) -> bool:
    """A Hub id is exactly "org/name"; anything else the user typed is meant as a place on disk."""
    return model.startswith((".", "/", "~", "\\")) or model.count("/") > 1 or Path(model).expanduser().exists()


def _use_downloaded(repo_id: str, folder: Path, go_online: str) -> Path:
    """The offline path: the folder an earlier download left, if it is whole. `go_online` says how to undo offline."""
    if not folder.is_dir() or not any(folder.iterdir()):
        raise HubError(f"{repo_id} is not in {folder}; {go_online} to download it")
    return verify_checkpoint(folder, hint=f"{go_online} to download it again")


def _download(repo_id: str, folder: Path, revision: str | None, endpoint: str | None, progress: bool) -> Path:
    """Bring `folder` up to date with the Hub, fetching only missing, outdated or damaged files."""
    try:
        commit = _resolve_commit(repo_id, revision, endpoint)
        _discard_damaged_weights(folder)
        snapshot_download(
            repo_id,
            revision=commit,
            local_dir=folder,
            allow_patterns=ALLOW_PATTERNS,
            ignore_patterns=IGNORE_PATTERNS,
            endpoint=endpoint,
            tqdm_class=None if progress else _NoProgressBar,
        )
    except Exception as error:
        message = _explain(error, repo_id, revision, folder, endpoint)
        if message is None:
            raise  # not a network, Hub or disk problem: a bug, keep the traceback
        if _is_unreachable(error) and _is_complete(folder):
            log.warning("%s; using the copy already in %s", message.split(";")[0], folder)
            return folder
        if Path(repo_id.split("/")[0]).is_dir():
            # "weights/tiny-qwen3" is also a valid Hub id: the user probably meant a folder that is not there.
            message = f"no folder {repo_id} here, so it was taken as a Hub id: {message}"
        raise HubError(message) from error
    return verify_checkpoint(folder)


def _resolve_commit(repo_id: str, revision: str | None, endpoint: str | None) -> str:
    """Ask the Hub which commit `revision` is, with a timeout.

    snapshot_download would ask too, but with no timeout at all, so a network that drops packets hangs it
    forever. Passing it the commit hash then skips that call (and pins every file to the same commit).
    """
    info = HfApi(endpoint=endpoint).model_info(repo_id, revision=revision, timeout=constants.HF_HUB_ETAG_TIMEOUT)
    return info.sha or revision or "main"


def _discard_damaged_weights(folder: Path) -> None:
    """Delete truncated weight files and git-LFS pointers so the download fetches them again.

    huggingface_hub trusts a local_dir file whose metadata names the current commit without looking at its
    size, so a file cut short (a full disk, a killed copy) would otherwise stay broken forever.
    """
    for path in folder.glob("*.safetensors"):
        try:
            read_raw_header(path)
        except DamagedFile:
            log.warning("%s is damaged; downloading it again", path)
            path.unlink()


def _is_complete(folder: Path) -> bool:
    try:
        verify_checkpoint(folder)
    except CheckpointError:
        return False
    return True


def _explain(error: Exception, repo_id: str, revision: str | None, folder: Path, endpoint: str | None) -> str | None:
    """One line saying what went wrong and what to do, or None if `error` is none of the known kinds.

    huggingface_hub often wraps the real cause (a refused connection inside a LocalEntryNotFoundError), so
    the whole chain is searched, outermost first.
    """
    for e in _chain(error):
        if isinstance(e, GatedRepoError):
            return (
                f"{repo_id} is gated: accept its license at {endpoint or constants.ENDPOINT}/{repo_id} and log in "
                "(`hf auth login` or HF_TOKEN)"
            )
        if isinstance(e, RepositoryNotFoundError):
            return f"{repo_id} was not found on the Hub: check the id (private repos also need `hf auth login`)"
        if isinstance(e, RevisionNotFoundError):
            return f"{repo_id} has no revision {revision!r} on the Hub: check the branch, tag or commit"
        if isinstance(e, HfHubHTTPError):
            status = e.response.status_code if e.response is not None else "?"
            return (
                f"the Hugging Face Hub refused to serve {repo_id} (HTTP {status}); "
                "try again later, log in if it is private, or pass a local folder"
            )
        if _is_transport_error(e):
            hub = endpoint or constants.ENDPOINT
            return (
                f"could not reach the Hugging Face Hub at {hub} to download {repo_id} ({_brief(e)}); "
                "check the network, or pass a local folder / --local-files-only"
            )
        if isinstance(e, OSError) and e.errno in DISK_ERRNOS:
            return (
                f"could not write {repo_id} into {folder} ({_brief(e)}); "
                "free some disk space or choose a weights folder you can write to"
            )
    return None


def _is_unreachable(error: Exception) -> bool:
    return any(_is_transport_error(e) for e in _chain(error))


def _is_transport_error(error: BaseException) -> bool:
    """A connection that failed or timed out, whichever HTTP library this huggingface_hub uses.

    huggingface_hub 2.x raises httpx2's errors, 1.x httpx's, 0.x requests'; they share no base class with
    the builtins, so they are recognised by their library. HTTP status errors arrive as HfHubHTTPError.
    """
    if isinstance(error, HfHubHTTPError):
        return False
    library = type(error).__module__.split(".")[0]
    return isinstance(error, (ConnectionError, TimeoutError)) or library in {"httpx", "httpx2", "requests", "urllib3"}


def _chain(error: BaseException):
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def _brief(error: BaseException) -> str:
    """The cause on one short line, for the end of a message."""
    text = " ".join(str(error).split()) or type(error).__name__
    return f"{type(error).__name__}: {text[:150]}"


class _NoProgressBar(HubProgressBar):
    """huggingface_hub's progress bar, always off (progress=False) without touching its global switch."""

    def __init__(self, *args, **kwargs):
        kwargs["disable"] = True
        super().__init__(*args, **kwargs)
