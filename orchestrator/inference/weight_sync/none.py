"""`none`: weights are loaded outside orch; the client only records the version it was told, and
reports a completion as sampled by the version known when it was sent, and ended at the version
known when it returned."""

from __future__ import annotations

from orchestrator.inference.weight_sync.base import EndpointT, WeightSyncClient, WeightSyncDialect


class NoSync(WeightSyncDialect):
    engine = None
    summary = "not at all"

    def known_version(self, client: WeightSyncClient[EndpointT], ep: EndpointT) -> int:
        """The version the client was told last (0 before any)."""
        return client.target[0] if client.target is not None else 0

    async def load(self, client: WeightSyncClient[EndpointT], ep: EndpointT, version: int, path: str) -> int:
        """Nothing to load (the client does not call it: `loads` is false): the version as told."""
        return version
