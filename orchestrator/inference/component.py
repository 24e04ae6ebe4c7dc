"""`openai`: OpenAI-compatible endpoints (vLLM, SGLang, `orch serve`) as the run's sampler: the
section (`inference.openai`, its settings in :mod:`.endpoints_config`), what it supports, its
pre-run step and its factory. No httpx here: the backend (:mod:`.endpoints_backend`) is imported
only when a run uses it."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from orchestrator.contracts import AgentEnv, BuildContext, InferenceComponent, RolloutEnv, RunPlan
from orchestrator.inference.endpoints_config import EndpointsSettings
from orchestrator.notices import warn_connection_cap

if TYPE_CHECKING:
    from orchestrator.inference.endpoints_backend import EndpointsBackend


class OpenAIConfig(InferenceComponent, EndpointsSettings):
    """OpenAI-compatible endpoints (vLLM, SGLang, `orch serve`) instead of the in-process sampler.

    Given (`endpoints`, or `routers` with the engines behind them), or vLLM servers the run starts
    and stops itself (`launch`)."""

    follows_weights: ClassVar[bool] = True
    refuses_synthetic: ClassVar[str | None] = "inference endpoints sample the model, not the {envs} env's episodes"
    sampler: ClassVar[str] = "the openai backend (inference.openai)"
    resumable: ClassVar[frozenset[str]] = frozenset(
        {
            "endpoints",
            "request_timeout_s",
            "preflight_timeout_s",
            "max_attempts",
            "backoff_s",
            "max_backoff_s",
            "pin_groups",
            "max_loras",
            "update_mode",
            "max_connections",
            "max_connections_per_endpoint",
            "stream_interval",
            "routers",
        }
    )

    def check(self, plan: RunPlan) -> None:
        if not self.enabled:
            raise ValueError("inference.kind='openai' needs inference.openai.endpoints, routers or launch.servers")
        servers = len(self.endpoints) + len(self.routers) or self.launch.servers
        caps = [("max_connections", self.max_connections, plan.requests_in_flight)]
        if self.max_connections_per_endpoint is not None:
            cap_of_all = self.max_connections_per_endpoint * servers
            caps.append(("max_connections_per_endpoint", cap_of_all, plan.requests_in_flight))
        for name, cap, needed in caps:
            warn_connection_cap(
                cap,
                needed,
                f"inference.openai.{name} allows {{cap}} connection(s) in all, fewer than the "
                "{needed} requests the run keeps in flight (rollout.max_inflight and eval.max_inflight): "
                "the others wait for a free one",
            )

    def served_model(self) -> str | None:
        return self.model

    def pulls_pushed_weights(self) -> bool:
        return self.dialect.pushed

    def launched_gpus(self) -> list[str]:
        return list(self.launch.gpus) if self.launch.servers else []

    def pushed_transport(self) -> str | None:
        return self.dialect.launched_push_transport(self.launch) if self.launch.servers else None

    def preflight_servers(self, weight_format: str | None) -> None:
        from orchestrator.inference.endpoints_backend import check_given_endpoints  # httpx: only now

        check_given_endpoints(self, weight_format)

    def preflight(self, model_dir: Path) -> None:
        from orchestrator.inference.endpoints_backend import check_inference  # httpx: only now

        check_inference(self, model_dir)

    def build(self, ctx: BuildContext, envs: Mapping[str, RolloutEnv | AgentEnv]) -> EndpointsBackend:
        from orchestrator.inference.endpoints_backend import build_endpoints_backend  # httpx: only now

        return build_endpoints_backend(self, ctx, envs)
