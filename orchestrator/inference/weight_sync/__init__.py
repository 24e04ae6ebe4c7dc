"""How endpoints load a published version (`inference.openai.weight_sync`), one module per engine
dialect, each a :class:`~.base.WeightSyncDialect` that owns its per-endpoint state and its waits;
the client (:mod:`orchestrator.inference.client`) routes, retries and streams, and calls the
dialect at fixed points of a load and of each sampling call. A dialect is a module and a line of
:data:`DIALECTS`.

* :mod:`.base`: the interface, what a dialect uses of the client, and their shared helpers (a
  load on every engine of a router; the weight versions held against the trainer's prune);
* :mod:`.none`: weights managed outside orch, the client only records the version it was told;
* :mod:`.orch`: `orch serve`'s ``/update_weights``;
* :mod:`.vllm_reload`: vLLM's full reload (pause, reload_weights, reset_prefix_cache, resume);
* :mod:`.vllm_lora`: vLLM's LoRA adapters, one per version;
* :mod:`.sglang`: SGLang's ``/update_weights_from_disk``;
* :mod:`.vllm_check`: the check of given vLLM endpoints before a run.
"""

from __future__ import annotations

from orchestrator.inference.weight_sync import none, orch, sglang, vllm_lora, vllm_reload
from orchestrator.inference.weight_sync.base import WeightSyncDialect

DIALECTS: dict[str, WeightSyncDialect] = {
    "none": none.NoSync(),
    "orch": orch.OrchServe(),
    "vllm_reload": vllm_reload.VllmReload(),
    "vllm_lora": vllm_lora.VllmLora(),
    "sglang": sglang.SGLang(),
}
