"""Turn `--model` into a checkpoint folder: a local folder as it is, or a Hub id downloaded into weights/<name>.

The download (`snapshot.py`, one file at a time by `download.py`) puts the Hub's files, under their Hub names,
into a plain folder (no symlinks into a cache), so the files a learner opens are the ones the Hub serves, each
checked against the Hub's hash. What this module adds:

- which folder `--model` means: a path (relative to the current folder) or a Hub id, and a clear line when
  it is neither;
- a check that the folder is complete before anyone loads it (`verify_checkpoint`);
- one-line errors that name the model and say what to do, instead of huggingface_hub's tracebacks.
"""

import errno
import logging
import re
from pathlib import Path

import huggingface_hub  # itself and its constants import in ~1 ms; its utils (~0.1 s) only once the Hub is asked
from huggingface_hub import constants

from qwen3_scratch.errors import CheckpointError, HubError, Qwen3Error

from .download import PARTIAL_DIR, DownloadLimits, is_transport_error
from .shards import DamagedFile, read_raw_header
from .snapshot import RECORD, check_against_record, read_record, sync_folder
from .weights import INDEX_FILE, checkpoint_files

log = logging.getLogger(__name__)


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
    verify: bool = False,
    limits: DownloadLimits | None = None,
) -> Path:
    """Return a verified checkpoint folder for `model`: an existing local folder, or a Hub id ("org/name").

    A Hub id is downloaded into `weights_dir/<name>`; files already there and up to date are not fetched
    again. `local_files_only` (or HF_HUB_OFFLINE in the environment) never touches the network.
    `endpoint` is the Hub's URL (default: huggingface.co, or HF_ENDPOINT). `verify` hashes every file again
    and compares it with the Hub's list (a folder we downloaded is checked against the commit it came from;
    offline, against the hashes recorded then). `limits` bounds time and size (see DownloadLimits).
    """
    limits = limits or DownloadLimits()
    local = _local_folder(model, weights_dir)
    if local is not None:
        if revision is not None:
            raise CheckpointError(f"--revision {revision} needs a Hub id, but {model} is a local folder: drop one")
        if not verify:
            return verify_checkpoint(local, hint=_hint_for(local))
        source = read_record(local)
        model, revision, folder = source.get("repo_id"), source.get("commit"), local
        if not (isinstance(model, str) and HUB_ID.fullmatch(model) and isinstance(revision, str)):
            raise CheckpointError(
                f"--verify: {local} has no record of the Hub repo it came from ({RECORD}); "
                "pass its Hub id (--model org/name) to check it against the Hub"
            )
    else:
        folder = Path(weights_dir).expanduser() / model.split("/")[1]
    if local_files_only:
        return _use_downloaded(model, folder, "run without --local-files-only", verify)
    if huggingface_hub.is_offline_mode():
        return _use_downloaded(model, folder, "HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is set: unset it", verify)
    return _download(model, folder, revision, endpoint, progress, verify, limits)


def verify_checkpoint(folder, *, hint: str = REPAIR_HINT) -> Path:
    """Check that `folder` holds config.json and every weight file it needs, whole; return it as a Path.

    Cheap on purpose (it reads only file headers): whether the tensors fit the config is the loader's job,
    whether the bytes are the Hub's is the download's. `hint` ends each error message with what to do.
    """
    folder = Path(folder)
    if (folder / "config.json").is_dir():
        raise CheckpointError(f"{folder / 'config.json'} is a folder, not a file; {hint}")
    if not (folder / "config.json").is_file():
        if not (folder / RECORD).is_file():  # not a download of ours: most likely the wrong folder
            raise CheckpointError(_not_a_checkpoint(folder))
        raise CheckpointError(f"{folder / 'config.json'} is missing; {hint}")
    for file in checkpoint_files(folder):
        try:
            read_raw_header(file)
        except DamagedFile as e:
            where = f" (named in {INDEX_FILE})" if (folder / INDEX_FILE).is_file() else ""
            raise CheckpointError(f"{file} {e.problem}{where}; {hint}") from e
    return folder


def _not_a_checkpoint(folder: Path) -> str:
    inside = sorted(p.parent.name for p in folder.glob("*/config.json"))
    guess = f"; did you mean {', '.join(str(folder / name) for name in inside[:3])}?" if inside else ""
    return (
        f"{folder} is not a checkpoint folder: it has no config.json; pass the folder that holds config.json and "
        f"the *.safetensors files, or a Hub id such as Qwen/Qwen3-0.6B{guess}"
    )


def _local_folder(model: str, weights_dir) -> Path | None:
    """The folder `model` names on disk, or None when it is a Hub id.

    A relative path starts in the current folder, as everywhere; "weights/<name>" (the download folder's
    own name first) is also looked up in `weights_dir`, and is never sent to the Hub as an org called "weights".
    """
    local = Path(model).expanduser()
    if local.is_dir():
        return local
    weights = Path(weights_dir).expanduser()
    in_weights = len(local.parts) == 2 and local.parts[0] == weights.name
    if in_weights and (weights / local.parts[1]).is_dir():
        return weights / local.parts[1]
    if in_weights:
        raise CheckpointError(f"no checkpoint folder at {model} (looked for {local.absolute()}){_what_to_do(local)}")
    if _looks_like_path(model) or not HUB_ID.fullmatch(model):
        what = "it is a file, not a folder" if local.exists() else f"looked for {local.absolute()}"
        raise CheckpointError(
            f"no checkpoint folder at {model} ({what}): pass an existing folder, or a Hub id such as Qwen/Qwen3-0.6B"
        )
    return None


def _what_to_do(local: Path) -> str:
    """For a missing "weights/<name>": the names that are there, or where a relative path starts."""
    if local.parent.is_dir():
        there = sorted(p.name for p in local.parent.iterdir() if (p / "config.json").is_file())[:5]
        return f": check the name ({local.parent}/ holds {', '.join(there) or 'no checkpoint'})"
    return (
        f": a relative path starts in the current folder; run from the folder that holds {local.parent}/, or pass "
        "the full path"
    )


def _looks_like_path(model: str) -> bool:
    """A Hub id is exactly "org/name"; anything else the user typed is meant as a place on disk."""
    return model.startswith((".", "/", "~", "\\")) or model.count("/") > 1 or Path(model).expanduser().exists()


def _hint_for(folder: Path) -> str:
    if (folder / RECORD).is_file():
        return REPAIR_HINT
    return "replace it with a whole copy (or pass a Hub id to download the checkpoint)"


def _use_downloaded(repo_id: str, folder: Path, go_online: str, verify: bool) -> Path:
    """The offline path: the folder an earlier download left, if it is whole. `go_online` says how to undo offline."""
    if not folder.is_dir() or not any(folder.iterdir()):
        raise HubError(f"{repo_id} is not in {folder}; {go_online} to download it")
    if verify:  # no Hub to ask: compare with the hashes recorded when the files were downloaded
        check_against_record(folder, f"{go_online} to download it again")
    return verify_checkpoint(folder, hint=f"{go_online} to download it again")


def _download(repo_id, folder: Path, revision, endpoint, progress, verify, limits) -> Path:
    """Bring `folder` up to date with the Hub, fetching only missing, outdated or damaged files."""
    endpoint = (endpoint or constants.ENDPOINT).rstrip("/")
    try:
        sync_folder(repo_id, revision, folder, endpoint=endpoint, verify=verify, limits=limits, progress=progress)
    except KeyboardInterrupt:
        log.warning("interrupted: the download of %s stops; what arrived is kept in %s and the next run continues "
                    "from there", repo_id, folder / PARTIAL_DIR)  # fmt: skip
        raise
    except Qwen3Error:
        raise  # already one line: ours
    except Exception as error:
        message = _explain(error, repo_id, revision, folder, endpoint)
        if message is None:
            raise  # not a network, Hub or disk problem: a bug, keep the traceback
        if is_unreachable(error) and _is_complete(folder):
            log.warning("%s; using the copy already in %s", message.split(";")[0], folder)
            return folder
        if Path(repo_id.split("/")[0]).is_dir():
            # "data/tiny-qwen3" is also a valid Hub id: the user probably meant a folder that is not there.
            message = f"no folder {Path(repo_id).absolute()}, so {repo_id} was taken as a Hub id: {message}"
        raise HubError(message) from error
    return verify_checkpoint(folder)


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
    from huggingface_hub.utils import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

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
        if is_transport_error(e):
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


def is_unreachable(error: Exception) -> bool:
    """A failed connection somewhere in the chain, and no HTTP answer from the Hub above it."""
    from huggingface_hub.utils import HfHubHTTPError

    for e in _chain(error):
        if isinstance(e, HfHubHTTPError):
            return False  # the Hub answered (404, 401...): being offline is not the problem
        if is_transport_error(e):
            return True
    return False


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
