"""Where a checkpoint's files are: a local directory, or a Hugging Face Hub repository (downloaded, or found in the
local cache), with one clear error for each way of not finding it.

`checkpoint_directory(name_or_path)` answers once, so that a caller (`from_pretrained`, the CLI, a server) reads a
local directory afterwards and never asks the network again: without a network, the Hub is tried once, not once per
file.
"""

from __future__ import annotations

import os

OFFLINE_HINT = (
    "check the network connection, or pass the path of a local copy; with the files in the Hugging Face cache, set "
    "HF_HUB_OFFLINE=1 to use them without asking the Hub"
)


def looks_like_a_path(name: str) -> bool:
    """Is `name` meant as a local path rather than a Hub repository id (`owner/name`)?"""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if name.startswith(("/", ".", "~")) or "\\" in name or name.count("/") > 1:
        return True
    try:
        validate_repo_id(name)
    except HFValidationError:
        return True
    return False


def checkpoint_directory(
    name_or_path: str | os.PathLike,
    cache_dir: str | os.PathLike | None = None,
    revision: str | None = None,
    token: str | bool | None = None,
    local_files_only: bool = False,
) -> str:
    """The local directory holding the checkpoint `name_or_path`: the directory itself, or the snapshot of the Hub
    repository of that id (downloaded if needed; the keywords are `huggingface_hub.snapshot_download`'s).

    Raises `FileNotFoundError` / `NotADirectoryError` for a local path that is not a directory, and `OSError` saying
    what to do when the Hub cannot be reached, does not have the repository, or refuses access.
    """
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    name = str(name_or_path)
    path = os.path.expanduser(name)
    if os.path.isdir(path):
        return path
    if os.path.exists(path):
        raise NotADirectoryError(
            f"{name!r} is a file; a Drama 3 checkpoint is a directory (config.json, model*.safetensors, codec.pth, "
            "tokenizer.json)"
        )
    parent = os.path.dirname(path.rstrip("/"))
    if parent and os.path.isdir(parent):  # "checkpoints/drama-3" with a local "checkpoints": a mistyped path
        raise FileNotFoundError(
            f"no checkpoint directory {name!r}: {parent!r} has no {os.path.basename(path.rstrip('/'))!r} in it"
        )
    if looks_like_a_path(name):
        raise FileNotFoundError(
            f"no checkpoint directory {name!r}: it does not exist (and it is not a Hub repository id such as "
            "'fishaudio/drama-3')"
        )
    try:
        return snapshot_download(
            name, cache_dir=cache_dir, revision=revision, token=token, local_files_only=local_files_only
        )
    except GatedRepoError as error:
        raise OSError(f"the Hub repository {name!r} is gated: accept its terms on huggingface.co and log in "
                      "(`hf auth login`)") from error
    except RepositoryNotFoundError as error:
        raise OSError(f"{name!r} is neither a local directory nor a Hub repository you can access (for a private "
                      "one, log in with `hf auth login`)") from error
    except RevisionNotFoundError as error:
        raise OSError(f"the Hub repository {name!r} has no revision {revision!r}") from error
    except (LocalEntryNotFoundError, OfflineModeIsEnabled) as error:
        if local_files_only or constants.HF_HUB_OFFLINE:
            raise OSError(f"{name!r} is not a local directory nor in the Hugging Face cache, and the Hub is not asked "
                      "(offline mode: "
                      "HF_HUB_OFFLINE or local_files_only): download it with a network first, or pass a local "
                      "directory") from error
        cause = error.__cause__ or error.__context__
        reason = f" ({type(cause).__name__}: {cause})" if cause is not None else ""
        raise OSError(f"{name!r} is not a local directory, and the Hugging Face Hub cannot be reached to download it"
                      f"{reason} nor is it in the local cache: {OFFLINE_HINT}") from error


__all__ = ["OFFLINE_HINT", "checkpoint_directory", "looks_like_a_path"]
