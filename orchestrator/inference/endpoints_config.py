"""`openai`: OpenAI-compatible endpoints (vLLM, SGLang, `orch serve`) as the run's sampler; the
endpoint URL rules the config and the client share. No httpx here: the backend
(:mod:`.endpoints_backend`) is imported only when a run uses it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, ClassVar, Literal
from urllib.parse import urlsplit

from pydantic import Field, model_validator

from orchestrator.components import BuildContext, InferenceComponent
from orchestrator.embedded.sampler_backend import check_samples_published_weights

if TYPE_CHECKING:
    from orchestrator.config import RunConfig
    from orchestrator.envs.base import RolloutEnv
    from orchestrator.inference.endpoints_backend import EndpointsBackend


class EndpointsConfig(InferenceComponent):
    """OpenAI-compatible endpoints (vLLM, SGLang, `orch serve`) instead of the in-process sampler."""

    follows_weights: ClassVar[bool] = True
    resumable: ClassVar[frozenset[str]] = frozenset({"endpoints", "request_timeout_s", "max_attempts", "backoff_s",
                                                     "max_backoff_s", "pin_groups"})
    endpoints: list[str] = Field(default_factory=list, description="base URLs (http://host:port); setting them "
                                 "selects this backend when inference.kind is not set")
    model: str | None = Field(None, description="model name sent with each request (None: the server's own)")
    weight_sync: Literal["orch", "vllm_lora", "sglang", "none"] = Field(
        "orch", description="how endpoints load weights/step_N: orch /update_weights, vLLM LoRA adapters, "
        "SGLang /update_weights_from_disk, or not at all")
    request_timeout_s: float = Field(120.0, gt=0, description="bound on one completion request")
    max_attempts: int = Field(3, ge=1, description="attempts per completion, over all endpoints (transport/5xx errors)")
    backoff_s: float = Field(1.0, gt=0, description="a failed endpoint rests this long (doubling per failure)")
    max_backoff_s: float = Field(30.0, gt=0, description="cap on that rest")
    pin_groups: bool = Field(True, description="send a group's episodes to one endpoint (prefix-cache reuse)")

    @model_validator(mode="after")
    def _endpoints_are_urls(self) -> EndpointsConfig:
        endpoint_base_urls(self.endpoints)
        return self

    def check(self, run: RunConfig) -> None:
        if set(run.envs) != {"reverse_text"}:
            raise ValueError("inference endpoints sample reverse_text episodes only")
        if not self.endpoints:
            raise ValueError("inference.kind='openai' needs inference.openai.endpoints")
        check_samples_published_weights(run, "inference endpoints")

    def build(self, ctx: BuildContext, envs: Mapping[str, RolloutEnv]) -> EndpointsBackend:
        from orchestrator.inference.client import InferenceClient  # httpx: only now
        from orchestrator.inference.endpoints_backend import EndpointsBackend

        config = ctx.config
        timeout_s = config.trainer.publish_timeout_s
        client = InferenceClient(self.endpoints, model=self.model, weight_sync=self.weight_sync,
                                 timeout_s=self.request_timeout_s, load_timeout_s=timeout_s,
                                 max_attempts=self.max_attempts, backoff_s=self.backoff_s,
                                 max_backoff_s=self.max_backoff_s, pin_groups=self.pin_groups)
        return EndpointsBackend(ctx.run_dir, envs, client, temperature=config.rollout.temperature,
                                max_new_tokens=config.rollout.max_new_tokens, seed=config.seed,
                                load_timeout_s=timeout_s)


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
    if (parts.scheme not in ("http", "https") or not parts.hostname or any(c.isspace() for c in url)
            or "@" in parts.netloc or parts.query or parts.fragment or parts.netloc.endswith(":")):
        raise ValueError(f"{what} is not an http(s)://host[:port] URL")


def endpoint_base_url(url: str) -> str:
    """An endpoint as the client addresses it: scheme added (http), trailing `/` and `/v1` removed."""
    url = url.strip()
    if "://" not in url:
        url = "http://" + url
    url = url.rstrip("/")
    return url.removesuffix("/v1")
