"""`openai`: OpenAI-compatible endpoints (vLLM, SGLang, `orch serve`) as the run's sampler; the
endpoint URL rules the config and the client share. No httpx here: the backend
(:mod:`.endpoints_backend`) is imported only when a run uses it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, ClassVar, Literal
from urllib.parse import urlsplit

from pydantic import Field, model_validator

from orchestrator.components import BuildContext, InferenceComponent, Section, synthetic_envs
from orchestrator.embedded.sampler_backend import check_samples_published_weights

if TYPE_CHECKING:
    from pathlib import Path

    from orchestrator.config import RunConfig
    from orchestrator.envs.base import AgentEnv, RolloutEnv
    from orchestrator.inference.endpoints_backend import EndpointsBackend


VLLM_MODES = ("vllm_reload", "vllm_lora")  # weight syncs of a vLLM server, which serves an HF model dir


class LaunchSection(Section):
    """vLLM servers that `orch run` starts itself (and stops at the end); 0 servers = none."""

    servers: int = Field(0, ge=0, description="vLLM servers to start (their URLs become the endpoints)")
    host: str = Field("127.0.0.1", description="address the servers bind")
    ports: list[int] = Field(default_factory=list, description="one port per server (empty: free ports)")
    gpus: list[str] = Field(
        default_factory=list,
        description='CUDA_VISIBLE_DEVICES of each server, e.g. ["0", "1"] (empty: vLLM on the CPU)',
    )
    extra_args: list[str] = Field(
        default_factory=list, description='more `vllm serve` flags, e.g. ["--dtype", "float32", "--enforce-eager"]'
    )
    env: dict[str, str] = Field(default_factory=dict, description="more environment variables for the servers")
    cpu_kvcache_gib: int = Field(1, ge=1, description="VLLM_CPU_KVCACHE_SPACE of a CPU server (GiB of KV cache)")
    max_lora_rank: int = Field(16, ge=1, description="--max-lora-rank (vllm_lora): at least the trainer's rank")
    ready_timeout_s: float = Field(600.0, gt=0, description="max wait for every server's /health")
    stop_timeout_s: float = Field(20.0, gt=0, description="SIGTERM, then SIGKILL after this long")

    @model_validator(mode="after")
    def _one_port_and_gpu_set_per_server(self) -> LaunchSection:
        for name, values in (("ports", self.ports), ("gpus", self.gpus)):
            if values and len(values) != self.servers:
                raise ValueError(
                    f"inference.openai.launch.{name} has {len(values)} entries for {self.servers} server(s)"
                )
        if any(not 0 < port < 65536 for port in self.ports) or len(set(self.ports)) != len(self.ports):
            raise ValueError("inference.openai.launch.ports must be distinct ports in 1..65535")
        return self


class EndpointsConfig(InferenceComponent):
    """OpenAI-compatible endpoints (vLLM, SGLang, `orch serve`) instead of the in-process sampler.

    Given (`endpoints`), or vLLM servers the run starts and stops itself (`launch`)."""

    follows_weights: ClassVar[bool] = True
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
        }
    )
    endpoints: list[str] = Field(
        default_factory=list,
        description="base URLs (http://host:port); setting them selects this backend when inference.kind is not set",
    )
    model: str | None = Field(None, description="model name sent with each request (None: the server's own)")
    weight_sync: Literal["orch", "vllm_reload", "vllm_lora", "sglang", "none"] = Field(
        "orch",
        description="how endpoints load weights/step_N: orch /update_weights, vLLM full reload "
        "(/pause, reload_weights, /reset_prefix_cache, /resume), vLLM LoRA adapters, "
        "SGLang /update_weights_from_disk, or not at all",
    )
    max_loras: int = Field(
        2,
        ge=2,
        description="vllm_lora: adapters an endpoint holds at most (--max-loras): the "
        "newest and those requests still use",
    )
    request_timeout_s: float = Field(120.0, gt=0, description="bound on one completion request")
    preflight_timeout_s: float = Field(
        10.0,
        ge=0,
        description="bound on the check of every given endpoint before the run (/v1/models, /health, "
        "its engine from its routes); 0: no check",
    )
    max_attempts: int = Field(3, ge=1, description="attempts per completion, over all endpoints (transport/5xx errors)")
    backoff_s: float = Field(1.0, gt=0, description="a failed endpoint rests this long (doubling per failure)")
    max_backoff_s: float = Field(30.0, gt=0, description="cap on that rest")
    pin_groups: bool = Field(True, description="send a group's episodes to one endpoint (prefix-cache reuse)")
    launch: LaunchSection = Field(
        default_factory=LaunchSection,
        description="the vLLM servers the run starts itself, and stops at its end (docs/vllm.md)",
    )

    @model_validator(mode="after")
    def _endpoints_are_urls(self) -> EndpointsConfig:
        endpoint_base_urls(self.endpoints)
        if self.launch.servers:
            if self.endpoints:
                raise ValueError(
                    "give inference.openai.endpoints or inference.openai.launch.servers, not both "
                    "(launched servers are the endpoints)"
                )
            if self.weight_sync not in (*VLLM_MODES, "none"):
                raise ValueError(
                    f"launched vLLM servers sync weights with weight_sync 'vllm_reload' or 'vllm_lora' "
                    f"(or 'none'), not {self.weight_sync!r}"
                )
        return self

    @property
    def enabled(self) -> bool:
        """Endpoints are given or launched."""
        return bool(self.endpoints or self.launch.servers)

    def check(self, run: RunConfig) -> None:
        synthetic = synthetic_envs(run)
        if synthetic:
            raise ValueError(f"inference endpoints sample the model, not the {', '.join(synthetic)} env's episodes")
        if not self.enabled:
            raise ValueError(
                "inference.kind='openai' needs inference.openai.endpoints or inference.openai.launch.servers"
            )
        check_samples_published_weights(run, "the openai backend (inference.openai)")

    def check_model(self, run: RunConfig, model_dir: Path) -> None:
        from orchestrator.inference.endpoints_backend import check_inference  # httpx: only now

        check_inference(run, model_dir)

    def build(self, ctx: BuildContext, envs: Mapping[str, RolloutEnv | AgentEnv]) -> EndpointsBackend:
        from orchestrator.inference.endpoints_backend import build_endpoints_backend  # httpx: only now

        return build_endpoints_backend(self, ctx, envs)


def endpoint_base_urls(urls: list[str]) -> list[str]:
    """The endpoints as the client addresses them (`endpoint_base_url`); ValueError naming the
    URL if one is not an http(s) URL or two are the same endpoint. The config checks it (exit 2
    before anything runs) and the client, also usable on its own, builds on it."""
    seen: dict[str, str] = {}
    for url in urls:
        base = endpoint_base_url(url)
        check_http_url(base, f"endpoint {url!r}")
        if base in seen:
            raise ValueError(f"endpoints {seen[base]!r} and {url!r} are the same")
        seen[base] = url
    return list(seen)


def check_http_url(url: str, what: str) -> None:
    """ValueError naming `what` unless `url` is http(s)://host[:port][/path] with a valid port
    (no spaces, user, query or fragment)."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError on a port that is not a number in 0-65535
    except ValueError:
        raise ValueError(f"{what} has an invalid host or port") from None
    if (
        parts.scheme not in ("http", "https")
        or not parts.hostname
        or any(c.isspace() for c in url)
        or "@" in parts.netloc
        or parts.query
        or parts.fragment
        or parts.netloc.endswith(":")
    ):
        raise ValueError(f"{what} is not an http(s)://host[:port] URL")


def endpoint_base_url(url: str) -> str:
    """An endpoint as the client addresses it: scheme added (http), trailing `/` and `/v1` removed."""
    url = url.strip()
    if "://" not in url:
        url = "http://" + url
    url = url.rstrip("/")
    return url.removesuffix("/v1")
