"""How endpoints load a published version (`inference.openai.weight_sync`), one module per engine
dialect, each a :class:`~.base.WeightSyncDialect` that owns its per-endpoint state and its waits;
the client (:mod:`orchestrator.inference.client`) routes, retries and streams, and calls the
dialect at fixed points of a load and of each sampling call. A dialect is a module and a line of
:data:`DIALECTS`: the config's names (`inference.openai.weight_sync`), its checks, the pre-run
checks and the launched servers ask the dialect (its engine, update modes, routes, launch flags
and environment) rather than name it.

* :mod:`.base`: the interface, what a dialect uses of the client, and their shared helpers (a
  load on every engine of a router; the weight versions held against the trainer's prune);
* :mod:`.none`: weights managed outside orch, the client only records the version it was told;
* :mod:`.orch`: `orch serve`'s ``/update_weights``;
* :mod:`.vllm_reload`: vLLM's full reload (pause, reload_weights, reset_prefix_cache, resume);
* :mod:`.vllm_lora`: vLLM's LoRA adapters, one per version;
* :mod:`.vllm_push`: the trainer process broadcasts each version into vLLM over a process group;
* :mod:`.sglang`: SGLang's ``/update_weights_from_disk``;
* :mod:`.vllm_check`: the check of given vLLM endpoints before a run.
"""

from __future__ import annotations

from collections.abc import Callable

from orchestrator.inference.weight_sync import none, orch, sglang, vllm_lora, vllm_push, vllm_reload
from orchestrator.inference.weight_sync.base import WeightSyncDialect

# In the order the config's docs and messages list them.
DIALECTS: dict[str, WeightSyncDialect] = {
    "orch": orch.OrchServe(),
    "vllm_reload": vllm_reload.VllmReload(),
    "vllm_lora": vllm_lora.VllmLora(),
    "vllm_push": vllm_push.VllmPush(),
    "sglang": sglang.SGLang(),
    "none": none.NoSync(),
}


def names_where(test: Callable[[WeightSyncDialect], bool]) -> str:
    """The dialects that pass ``test``, as a message offers them: 'a' or 'b'."""
    return " or ".join(repr(name) for name, dialect in DIALECTS.items() if test(dialect))
