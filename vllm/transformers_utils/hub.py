"""Model and tokenizer names -> local folders: demo names, local folders and hub model IDs.

A name is, in this order:

1. a built-in demo name (``demo/mllama-tiny``; the ``demo/`` namespace is reserved for them),
2. an existing local folder,
3. a Hugging Face hub model ID (``meta-llama/Llama-3.2-11B-Vision-Instruct``), resolved with
   ``huggingface_hub.snapshot_download``: the files the engine reads are downloaded into the
   hub cache (``HF_HUB_CACHE``, else ``$HF_HOME/hub``; ``--download-dir`` replaces it) when the
   hub is reachable, and the cached snapshot is used when it is not or when ``HF_HUB_OFFLINE=1``.
   ``HF_ENDPOINT`` and ``HF_TOKEN`` are huggingface_hub's own variables; it reads them itself.

Anything else is a :class:`ModelNotFoundError` whose message says what was tried.
"""

from __future__ import annotations

from pathlib import Path

from vllm.logger import init_logger
from vllm.transformers_utils.demo_checkpoints import (
    DEMO_MODELS,
    get_demo_checkpoint,
    is_demo_model,
)

logger = init_logger(__name__)

# What the engine reads from a checkpoint: configs, tokenizer and processor files, chat
# templates, safetensors shards. Meta's repositories also carry ``original/`` (consolidated
# PyTorch weights for Meta's own code), which is never downloaded.
CONFIG_PATTERNS = ("*.json", "*.jinja", "tokenizer.model")
WEIGHT_PATTERNS = ("*.safetensors",)
IGNORE_PATTERNS = ("original/*",)
DEMO_NAMESPACE = "demo/"


class ModelNotFoundError(FileNotFoundError):
    """A model or tokenizer name is neither a demo name, a local folder, nor a hub model ID
    that is cached or can be downloaded."""


def resolve_model(
    name: str,
    *,
    revision: str | None = None,
    download_dir: str | None = None,
    weights: bool = True,
    token: str | bool | None = None,
) -> Path:
    """The local folder holding checkpoint ``name`` (see the module docstring).

    ``revision`` (a branch, tag or commit), ``download_dir`` and ``token`` (``--hf-token``;
    default: huggingface_hub's, ``HF_TOKEN`` or a saved login) apply to hub IDs only;
    ``weights=False`` fetches the configuration and tokenizer files without the shards (for
    ``--load-format dummy`` and for a separate tokenizer).
    """
    if is_demo_model(name):
        return get_demo_checkpoint(name)
    if name.startswith(DEMO_NAMESPACE):
        raise ModelNotFoundError(
            f"unknown demo checkpoint {name!r}; the demo names are: {', '.join(DEMO_MODELS)}"
        )
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    if not looks_like_hub_id(name):
        raise ModelNotFoundError(
            f"model {name!r}: no such folder, and not a Hugging Face hub ID (namespace/name). "
            f"Pass a checkpoint folder, a hub ID, or a demo name ({', '.join(DEMO_MODELS)})."
        )
    patterns = [*CONFIG_PATTERNS, *(WEIGHT_PATTERNS if weights else ())]
    return download_snapshot(name, revision, download_dir, patterns, token)


def looks_like_hub_id(name: str) -> bool:
    """True for names huggingface_hub accepts as a model ID and that do not look like a path."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if name.startswith((".", "/", "~")) or name.endswith("/"):
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def download_snapshot(
    repo_id: str,
    revision: str | None,
    download_dir: str | None,
    patterns: list[str],
    token: str | bool | None = None,
) -> Path:
    """``snapshot_download`` of the files matching ``patterns``; hub errors become a
    :class:`ModelNotFoundError` that names the model, the revision and the cache."""
    import huggingface_hub
    from huggingface_hub import constants

    cache = download_dir or constants.HF_HUB_CACHE
    where = f"{repo_id!r}" + (f" (revision {revision!r})" if revision else "")
    try:
        folder = huggingface_hub.snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=download_dir,
            allow_patterns=patterns,
            ignore_patterns=list(IGNORE_PATTERNS),
            token=token,
        )
    except Exception as e:  # every hub failure is reported the same way, below
        raise ModelNotFoundError(_explain(e, where, cache)) from e
    logger.info("Model %s: using %s", where, folder)
    return Path(folder)


def _explain(error: Exception, where: str, cache: str) -> str:
    """One message for a failed ``snapshot_download``."""
    from huggingface_hub import constants, errors
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if isinstance(error, RevisionNotFoundError):
        return f"model {where}: the hub has no such revision (--revision)."
    if isinstance(error, GatedRepoError):
        return (
            f"model {where}: the repository is gated; accept its license on the hub and set "
            "HF_TOKEN (or --hf-token) to a token with access."
        )
    if isinstance(error, RepositoryNotFoundError):
        return (
            f"model {where}: no such folder, and the hub has no such model (or it is private: "
            "set HF_TOKEN or --hf-token)."
        )
    incomplete = getattr(errors, "IncompleteSnapshotError", ())  # huggingface_hub >= 2
    offline = "hub access is off (HF_HUB_OFFLINE=1)"
    if incomplete and isinstance(error, incomplete):
        why = offline if constants.HF_HUB_OFFLINE else "the hub cannot be reached"
        return (
            f"model {where}: the snapshot in the hub cache {cache} is incomplete (an "
            f"interrupted download?) and {why}. Run the same command where the hub is "
            "reachable to complete it."
        )
    if isinstance(error, LocalEntryNotFoundError):
        why = (
            offline
            if constants.HF_HUB_OFFLINE
            else f"the hub cannot be reached ({_first_line(error)})"
        )
        return (
            f"model {where} is not a local folder and is not in the hub cache {cache}, and "
            f"{why}. Download it where the hub is reachable (the same command does), or pass "
            "a checkpoint folder."
        )
    return f"model {where}: cannot be fetched from the hub ({type(error).__name__}: " + (
        f"{_first_line(error)})."
    )


def _first_line(error: BaseException) -> str:
    cause = error.__cause__ or error
    text = str(cause).strip().splitlines()
    return text[0] if text else type(cause).__name__
