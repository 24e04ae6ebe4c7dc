"""How endpoints load a published version (`inference.openai.weight_sync`), one module per engine
dialect; the client (:mod:`orchestrator.inference.client`) routes, retries and tracks versions,
and hands each endpoint's load to its dialect. `none` has no module: weights are managed outside
orch, the client only records the version it was told.

* :mod:`.orch`: `orch serve`'s ``/update_weights``;
* :mod:`.vllm_reload`: vLLM's full reload (pause, reload_weights, reset_prefix_cache, resume);
* :mod:`.vllm_lora`: vLLM's LoRA adapters, one per version;
* :mod:`.sglang`: SGLang's ``/update_weights_from_disk``;
* :mod:`.vllm_check`: the check of given vLLM endpoints before a run.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Protocol

from orchestrator.inference.weight_sync import orch, sglang, vllm_lora, vllm_reload
from orchestrator.inference.weight_sync.base import EndpointT, WeightSyncClient


class Load(Protocol):
    """A dialect's load(client, endpoint, version, weights dir) -> the version the endpoint confirmed."""

    def __call__(
        self, client: WeightSyncClient[EndpointT], ep: EndpointT, version: int, path: str
    ) -> Awaitable[int]: ...


DIALECTS: dict[str, Load] = {
    "orch": orch.load,
    "vllm_reload": vllm_reload.load,
    "vllm_lora": vllm_lora.load,
    "sglang": sglang.load,
}
