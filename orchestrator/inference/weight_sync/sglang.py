"""`sglang`: SGLang reloads full weights in place, ``POST /update_weights_from_disk
{"model_path": dir}`` -> ``{"success": true}``; the version is the one it confirmed."""

from __future__ import annotations

from orchestrator.inference.errors import InferenceRequestError
from orchestrator.inference.weight_sync.base import (
    EndpointT,
    WeightSyncClient,
    WeightSyncDialect,
    on_each_engine,
    versions_held,
)


class SGLang(WeightSyncDialect):
    engine = "sglang"
    summary = "SGLang /update_weights_from_disk"

    async def load(self, client: WeightSyncClient[EndpointT], ep: EndpointT, version: int, path: str) -> int:
        async with versions_held(path, client.load_timeout_s):
            answers = await on_each_engine(
                client, ep, "POST", "/update_weights_from_disk", {"model_path": path}, timeout=client.load_timeout_s
            )
        for url, answer in zip(ep.admin_urls, answers, strict=True):
            if not (isinstance(answer, dict) and answer.get("success") is True):
                raise InferenceRequestError(f"{url}/update_weights_from_disk refused {path}: {answer!r}")
        return version
