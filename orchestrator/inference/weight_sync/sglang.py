"""`sglang`: SGLang reloads full weights in place, ``POST /update_weights_from_disk
{"model_path": dir}`` -> ``{"success": true}``; the version is the one it confirmed."""

from __future__ import annotations

from orchestrator.inference.errors import InferenceRequestError
from orchestrator.inference.weight_sync.base import EndpointT, WeightSyncClient


async def load(client: WeightSyncClient[EndpointT], ep: EndpointT, version: int, path: str) -> int:
    answer = await client.call(
        ep, "POST", "/update_weights_from_disk", {"model_path": path}, timeout=client.load_timeout_s
    )
    if not (isinstance(answer, dict) and answer.get("success") is True):
        raise InferenceRequestError(f"{ep.url}/update_weights_from_disk refused {path}: {answer!r}")
    return version
