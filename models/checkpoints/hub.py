"""Checkpoints named on the Hugging Face Hub: ``ORG/NAME`` resolved to a local snapshot
directory through ``huggingface_hub`` (its cache, ``HF_HUB_OFFLINE``, ``revision``)."""

from __future__ import annotations

import os
import pathlib

from forge_jax.models.checkpoints.generation_config import CheckpointError

# What the loaders read (llama_checkpoint, text): nothing else is downloaded.
ALLOW_PATTERNS = (
    "config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
    "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
    "special_tokens_map.json",
)


def _error(message: str) -> Exception:

    return CheckpointError(message)


def expand_user(path: str | os.PathLike) -> str | pathlib.Path:
    """``path`` with a leading ``~`` (or ``~user``) expanded to the home directory, as a
    shell would (``from_pretrained("~/models/SmolLM2")``, a ``.gguf`` file alike); a string
    stays a string (it may be a Hub name, which never starts with ``~``)."""
    if isinstance(path, str):
        return os.path.expanduser(path)
    return pathlib.Path(path).expanduser()


def is_repo_id(name: str) -> bool:
    """Whether ``name`` is a valid Hub repository id (``ORG/NAME``)."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if name.count("/") != 1:
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def resolve_checkpoint(path: str | os.PathLike, *, revision: str | None = None) -> pathlib.Path:
    """The local directory of a checkpoint: ``path`` itself when it exists (a local directory
    always wins over a Hub name), else the snapshot of the Hub repository ``path`` names
    (``ORG/NAME``), downloaded into (or, with ``HF_HUB_OFFLINE=1``, read from) the
    ``huggingface_hub`` cache at ``revision`` (a branch, tag or commit; default main).

    Raises:
      CheckpointError (a ValueError): ``path`` is neither an existing path nor a valid
        repository id; the repository or revision is not on the Hub; offline with the
        snapshot not cached.
    """
    path = expand_user(path)
    local = pathlib.Path(path)
    if local.exists() or not isinstance(path, str):
        if revision is not None:
            raise _error(f"revision={revision!r} applies to Hub names only; {str(path)!r} is "
                         f"a local path")
        return local
    if not is_repo_id(path):
        raise _error(f"checkpoint directory {path!r} does not exist, and it is not a Hugging "
                     f"Face Hub repository id (ORG/NAME) either")
    import huggingface_hub
    from huggingface_hub import errors

    at = "" if revision is None else f" at revision {revision!r}"
    try:
        return pathlib.Path(huggingface_hub.snapshot_download(
            path, revision=revision, allow_patterns=list(ALLOW_PATTERNS)))
    except errors.LocalEntryNotFoundError:
        from huggingface_hub import constants

        if constants.HF_HUB_OFFLINE:
            raise _error(f"{path}{at} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) "
                         f"and HF_HUB_OFFLINE=1 forbids downloading it: unset HF_HUB_OFFLINE "
                         f"or download it first") from None
        raise _error(f"cannot download {path}{at} from the Hugging Face Hub and it is not in "
                     f"the cache ({constants.HF_HUB_CACHE}): check the network") from None
    except errors.RevisionNotFoundError:
        raise _error(f"{path} has no revision {revision!r} on the Hugging Face Hub") from None
    except (errors.RepositoryNotFoundError, errors.GatedRepoError) as e:
        raise _error(f"cannot open {path} on the Hugging Face Hub (missing, private or "
                     f"gated: {type(e).__name__})") from None
