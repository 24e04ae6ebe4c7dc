"""orch's vLLM general plugin (the ``vllm.general_plugins`` entry point ``orch_weight_push`` in
pyproject.toml): vLLM calls :func:`register` in each of its processes (API server, engine core,
workers) before it builds a worker, so the ``orch_gloo`` weight-transfer backend is known where
``--weight-transfer-config '{"backend": "orch_gloo"}'`` creates the engine. Light: it imports
the engine module only when vLLM creates one."""

from __future__ import annotations

from orchestrator.weight_push import GLOO_BACKEND


def register() -> None:
    """Register the backend with vLLM's factory once (plugins may be loaded more than once)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(
            GLOO_BACKEND, "orchestrator.weight_push.vllm_engine", "OrchGlooWeightTransferEngine"
        )
    except ValueError:  # already registered in this process
        pass
