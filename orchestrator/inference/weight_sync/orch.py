"""`orch`: `orch serve`'s own weight load, ``POST /update_weights {"path", "version"}`` ->
``{"version": N}`` (its completions carry the version that sampled them)."""

from __future__ import annotations

from pathlib import Path

from orchestrator.inference.errors import InferenceRequestError
from orchestrator.inference.weight_sync.base import (
    EndpointT,
    WeightSyncClient,
    WeightSyncDialect,
    on_each_engine,
    versions_held,
)


class OrchServe(WeightSyncDialect):
    engine = "orch"
    summary = "orch /update_weights"

    async def load(self, client: WeightSyncClient[EndpointT], ep: EndpointT, version: int, path: str) -> int:
        async with versions_held(path, client.load_timeout_s):
            answers = await on_each_engine(
                client, ep, "POST", "/update_weights", {"path": path, "version": version}, timeout=client.load_timeout_s
            )
        confirmed = []
        for url, answer in zip(ep.admin_urls, answers, strict=True):
            said = answer.get("version") if isinstance(answer, dict) else None
            if not isinstance(said, int) or said < version:
                raise InferenceRequestError(
                    f"{url}/update_weights: asked for version {version}, the endpoint answered {answer!r}"
                )
            served = answer.get("path")
            if isinstance(served, str) and Path(served).parent != Path(path).parent:
                raise InferenceRequestError(
                    f"{url}/update_weights: asked for {path}, the endpoint serves {served}, another run's weights"
                )
            confirmed.append(said)
        return min(confirmed)
