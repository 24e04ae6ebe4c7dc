"""The `inference.openai` section's settings: OpenAI-compatible endpoints (vLLM, SGLang, `orch
serve`), given or launched (the component is :mod:`.component`). Light: pydantic."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field, model_validator

from orchestrator.contracts import Section
from orchestrator.inference.weight_sync import DIALECTS, names_where
from orchestrator.inference.weight_sync.base import UpdateMode, WeightSyncDialect
from orchestrator.urls import endpoint_base_urls

# `inference.openai.weight_sync`: a dialect's name, as the config reads and documents it (the
# registry's, which a type checker cannot read: a str to it).
if TYPE_CHECKING:
    WeightSyncName = str
else:
    WeightSyncName = Literal[tuple(DIALECTS)]
STREAM_INTERVAL = 64  # tokens per streamed chunk asked of vLLM; 1 sends no field (docs/vllm.md, "Streamed chunks")


def _weight_sync_description() -> str:
    """Each dialect's way of loading a version, in the registry's order."""
    *others, last = (dialect.summary for dialect in DIALECTS.values())
    return f"how endpoints load weights/step_N: {', '.join(others)}, or {last}"


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
    max_restarts: int = Field(
        2, ge=0, description="a server that dies or freezes is restarted this many times (each logged)"
    )
    health_timeout_s: float = Field(
        5.0, gt=0, description="a running server that does not answer /health within this is frozen: restarted"
    )

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


class RouterSection(Section):
    """A router in front of engines (vllm-router, sglang-router): the run samples through it, and
    loads weights on each engine directly (docs/scaling-out.md, "Behind a router")."""

    url: str = Field(description="the router's base URL (http://host:port), sampled like an endpoint")
    engines: list[str] = Field(
        default_factory=list,
        description="base URLs of the engines behind it, where each weight load goes (their admin routes: "
        "/pause, /collective_rpc, ...); empty only with weight_sync 'none'",
    )
    session_header: str = Field(
        "X-Session-ID",
        min_length=1,
        description="the header each request names its group in, so that a sticky router (vllm-router's "
        "consistent_hash, sglang-router's) keeps a group's shared prompt on one engine",
    )


class EndpointsSettings(Section):
    """The `inference.openai` section's settings: the endpoints, given or launched, and how the
    client talks to them."""

    endpoints: list[str] = Field(
        default_factory=list,
        description="base URLs (http://host:port); setting them selects this backend when inference.kind is not set",
    )
    model: str | None = Field(None, description="model name sent with each request (None: the server's own)")
    weight_sync: WeightSyncName = Field(
        "orch",
        description=_weight_sync_description(),
    )
    update_mode: Literal["wait", "interrupt", "keep"] | None = Field(
        None,
        description="vllm_reload and vllm_push: what a weight update does to the requests running: wait "
        "for them to end (new ones held), interrupt them (abort, reload, continue each with its tokens so "
        "far), or keep them (frozen through the load, then continued by the engine with the new weights, "
        "their KV computed again; sampled on vLLM's /inference/v1/generate, which says each token's "
        "version: servers started with --enable-scale-out). Every token's version is exact in each "
        "(docs/vllm.md). None: interrupt with vllm_reload and vllm_push, wait with the others",
    )
    max_loras: int = Field(
        2,
        ge=2,
        description="vllm_lora: adapters an endpoint holds at most (--max-loras): the "
        "newest and those requests still use",
    )
    request_timeout_s: float = Field(
        120.0,
        gt=0,
        description="bound on each wait for a completion request's answer (streamed, in update_mode interrupt: "
        "for each of its chunks)",
    )
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
    max_connections: int | None = Field(
        None,
        ge=1,
        description="HTTP connections to all endpoints together, at most (None: no cap, as many as requests "
        "in flight); a request beyond it waits for a free one",
    )
    max_connections_per_endpoint: int | None = Field(
        None,
        ge=1,
        description="HTTP connections to one endpoint (host and port), at most (None: no cap); each is one "
        "request in flight there",
    )
    stream_interval: int = Field(
        STREAM_INTERVAL,
        ge=1,
        description="tokens per streamed chunk that vLLM sends, asked as the request field stream_interval "
        "in every streamed request (update_mode interrupt streams its /v1/completions calls; nothing else "
        "is streamed): the first and last tokens, and every token on an abort, come at once; the versions "
        "stay exact; each chunk must come within request_timeout_s; 1: no field sent, one chunk per token",
    )
    routers: list[RouterSection] = Field(
        default_factory=list,
        description="routers to sample through, beside or instead of endpoints, each with its engines "
        "(docs/scaling-out.md)",
    )
    launch: LaunchSection = Field(
        default_factory=LaunchSection,
        description="the vLLM servers the run starts itself, and stops at its end (docs/vllm.md)",
    )

    @model_validator(mode="after")
    def _endpoints_are_urls(self) -> EndpointsSettings:
        # Each URL once, engines too: two listings of one engine would race their reloads.
        endpoint_base_urls(self.endpoints + [url for router in self.routers for url in (router.url, *router.engines)])
        for index, router in enumerate(self.routers):
            if not router.engines and self.dialect.loads:
                raise ValueError(
                    f"inference.openai.routers[{index}] ({router.url}) lists no engines: weight_sync "
                    f"{self.weight_sync!r} loads each engine behind the router directly (their URLs in engines)"
                )
        mode = self.update_mode
        if mode is not None and mode not in self.dialect.update_modes:
            raise ValueError(
                f"inference.openai.update_mode {mode!r} needs weight_sync "
                f"{names_where(lambda dialect: mode in dialect.update_modes)}, not {self.weight_sync!r}"
                + (f" ({note})" if (note := self.dialect.update_modes_note) else "")
            )
        if mode == "keep" and self.routers:
            raise ValueError(
                "inference.openai.update_mode 'keep' is not offered through routers (it samples on vLLM's "
                "/inference/v1/generate, whose routing by a router orch does not check): list the engines "
                "as endpoints, or use update_mode 'interrupt'"
            )
        if self.launch.servers:
            if self.endpoints or self.routers:
                raise ValueError(
                    "give inference.openai.endpoints (or routers) or inference.openai.launch.servers, not both "
                    "(launched servers are the endpoints)"
                )
            if self.dialect.loads and self.dialect.engine != "vllm":
                raise ValueError(
                    "launched vLLM servers sync weights with weight_sync "
                    f"{names_where(lambda dialect: dialect.engine == 'vllm')} "
                    f"(or {names_where(lambda dialect: not dialect.loads)}), not {self.weight_sync!r}"
                )
        return self

    @property
    def dialect(self) -> WeightSyncDialect:
        """The weight sync's dialect, which the checks ask what it needs and offers."""
        return DIALECTS[self.weight_sync]

    @property
    def update_mode_in_use(self) -> UpdateMode:
        """`update_mode`, or the weight sync's default where it is not set."""
        if self.update_mode is None:
            return self.dialect.default_update_mode
        return self.update_mode

    @property
    def enabled(self) -> bool:
        """Endpoints are given or launched."""
        return bool(self.endpoints or self.routers or self.launch.servers)
