"""Where a run's model is: `model.path`, a local dir or a Hugging Face Hub id found in the
Hugging Face cache (a leaf: huggingface_hub, imported only when an id is resolved). The run's
trainer (`orchestrator.hf`) and the tools that read a run (`orchestrator.observe.text`) resolve
it the same way."""

from __future__ import annotations

import os
import re
from pathlib import Path

from orchestrator.notices import one_line


class ModelError(ValueError):
    """A model dir, model id, tokenizer or LoRA setting that cannot work; one-line message."""


HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # owner/name, as the Hugging Face Hub spells a repo


def hub_cache() -> Path:
    """The Hugging Face cache the hub reads (HF_HUB_CACHE, else HF_HOME/hub, else its default)."""
    from huggingface_hub import constants

    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]) / "hub"
    return Path(constants.HF_HUB_CACHE)


def resolve_model_path(path: Path, log=print, *, local_only: bool = False) -> Path:
    """`path` itself if it exists or is no Hub id; a Hub id (`Qwen/Qwen3-0.6B`) as its snapshot
    dir in the Hugging Face cache, offline first: downloaded (saying so first, through `log`) only
    if it is not there, HF_HUB_OFFLINE is not set and not `local_only` (ModelError, one line naming
    the cache, otherwise). An id the Hub would refuse (`org/model--v1`) is ModelError too."""
    if path.exists() or not HUB_ID.fullmatch(str(path)):
        return path
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError
    from huggingface_hub.utils import validate_repo_id

    repo_id, cache = str(path), hub_cache()
    try:
        validate_repo_id(repo_id)
    except ValueError as err:  # HFValidationError
        raise ModelError(
            f"model.path {repo_id!r} is neither a local dir nor a Hugging Face Hub id ({one_line(err)})"
        ) from None
    try:
        return Path(snapshot_download(repo_id, cache_dir=cache, local_files_only=True))
    except LocalEntryNotFoundError:
        offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
        if offline or local_only:
            why = "HF_HUB_OFFLINE is set: " if offline else ""
            raise ModelError(
                f"model.path {repo_id!r} is neither a local dir nor in the Hugging Face cache {cache} "
                f"({why}fetch it where there is a network, `hf download {repo_id}`)"
            ) from None
    log(f"orch: downloading {repo_id} from the Hugging Face Hub into {cache}; set HF_HUB_OFFLINE=1 to refuse instead")
    try:
        return Path(snapshot_download(repo_id, cache_dir=cache))
    except Exception as err:  # noqa: BLE001 - the hub's errors (network, auth, no such repo) have no one base
        message = one_line(err)[:200]
        raise ModelError(
            f"model.path {repo_id!r} is neither a local dir nor in the Hugging Face cache {cache}, and its "
            f"download failed: {type(err).__name__}: {message}"
        ) from None
