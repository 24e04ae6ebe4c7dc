"""Run configuration: one pydantic model, loadable from TOML, with dotted `--set` overrides.

Every knob of the rules (docs/rules.md) is a field here with a documented default; `core_params()` extracts the
part the core folds (it travels in `run_started`, so a log is self-describing).
"""

from __future__ import annotations

import copy
import hashlib
import tomllib
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from orchestrator.core.advantages import BACKGROUND_ONLY
from orchestrator.core.events import CoreParams, EvalParams
from orchestrator.envs.verifiers_config import VerifiersSection
from orchestrator.envs.verifiers_config import check as check_verifiers


class ConfigError(ValueError):
    """A user mistake in the configuration; its message is one line."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class RolloutConfig(_Section):
    group_size: int = Field(8, ge=1, description="episodes per group (one task)")
    max_inflight: int = Field(128, ge=1, description="in-flight episode permits (a hard cap, capacity or not)")
    capacity: Literal["staleness", "off"] = Field(
        "staleness", description="staleness: start a group only while the work dispatched and not yet shipped or "
        "dropped can still train before it is too old (docs/rules.md, the dispatch capacity); off: max_inflight alone")
    temperature: float = Field(1.0, gt=0, description="sampling temperature of the embedded policy")
    max_new_tokens: int = Field(48, ge=1, description="completion length cap of the embedded policy (answers need <= 38)")
    env_server: str | None = Field(None, description="URL of an `orch env-server` serving reverse_text (else envs "
                                   "run in-process)")

    @model_validator(mode="after")
    def _env_server_is_a_url(self) -> RolloutConfig:
        if self.env_server is not None:
            check_http_url(self.env_server, f"env_server {self.env_server!r}")
        return self


class BatchConfig(_Section):
    size: int = Field(128, ge=1, description="traces per batch")
    token_size: int | None = Field(None, ge=1, description="if set, batch by tokens instead of traces")
    constant_trainer_batch_size: bool = Field(False, description="prune zero-advantage samples before the cut")


class OffPolicyConfig(_Section):
    target_lag: int = Field(1, ge=0, description="batch N ships once the trainer published N-1-target_lag")
    max_off_policy_steps: int = Field(2, ge=0, description="oldest usable policy: (step-1) - this")


class GraderConfig(_Section):
    """The simulated slow grader used by `gar` (a real judge endpoint can replace it)."""

    delay_s: float = Field(0.05, ge=0, description="mean grader latency")
    jitter_s: float = Field(0.02, ge=0, description="uniform +- jitter on the latency")
    failure_rate: float = Field(0.0, ge=0, le=1, description="probability a grader call raises")
    rank_noise: float = Field(0.1, ge=0, description="noise added to rewards before ranking")
    rank_weight: float = Field(0.5, ge=0, le=1, description="gar blend: weight of the grader rank")


class AlgorithmConfig(_Section):
    name: Literal["grpo", "gar"] = Field("grpo", description="grpo (inline) or gar (grader, background)")
    finalize_in_background: bool | None = Field(None, description="override the algorithm's class flag")
    max_finalizing_groups: int = Field(64, ge=1, description="finalizing groups per env that close the gate")
    grader: GraderConfig = Field(default_factory=GraderConfig)


class FakeEnvConfig(_Section):
    """The `fake` env: seeded synthetic episodes, no model (tests and benchmarks)."""

    latency_s: float = Field(0.0, ge=0, description="mean episode latency (0 = instant)")
    latency_jitter_s: float = Field(0.0, ge=0, description="uniform +- jitter on the latency")
    error_rate: float = Field(0.0, ge=0, le=1, description="probability an episode raises")
    empty_rate: float = Field(0.0, ge=0, le=1, description="probability an episode samples no token")
    prompt_tokens: int = Field(8, ge=0, description="prompt length of every fake episode, in tokens")
    min_tokens: int = Field(4, ge=1, description="shortest completion, in sampled tokens")
    max_tokens: int = Field(16, ge=1, description="longest completion, in sampled tokens")

    @model_validator(mode="after")
    def _range(self) -> FakeEnvConfig:
        if self.min_tokens > self.max_tokens:
            raise ValueError("fake_env.min_tokens must be <= fake_env.max_tokens")
        return self


class ReverseTextConfig(_Section):
    min_len: int = Field(3, ge=1, description="shortest string to reverse, in characters")
    max_len: int = Field(6, ge=1, description="longest string to reverse, in characters")


class TrainerSection(_Section):
    kind: Literal["embedded", "fake"] = Field("embedded", description="torch trainer process or in-process fake")
    step_time_s: float = Field(0.0, ge=0, description="fake trainer: time per optimizer step")
    lr: float = Field(2e-3, gt=0, description="embedded trainer: learning rate")
    sft_steps: int = Field(400, ge=0, description="embedded trainer: most warm-start steps (it stops at a loss of 0.12)")
    publish_timeout_s: float = Field(300.0, gt=0, description="max wait for the trainer's next version")
    exit_timeout_s: float = Field(30.0, gt=0, description="max wait for the trainer to exit at the end")
    nproc: int = Field(1, ge=1, description="embedded trainer: ranks under torchrun (DDP); 1 = one plain process")
    ddp_backend: Literal["auto", "gloo", "nccl"] = Field("auto", description="DDP backend (auto: nccl with CUDA, else gloo)")


class InferenceSection(_Section):
    """OpenAI-compatible endpoints (vLLM, SGLang, `orch serve`) instead of the in-process sampler."""

    endpoints: list[str] = Field(default_factory=list, description="base URLs (http://host:port); empty = embedded sampler")
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
    def _endpoints_are_urls(self) -> InferenceSection:
        endpoint_base_urls(self.endpoints)
        return self


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
    return url[:-3] if url.endswith("/v1") else url


class EvalConfig(_Section):
    """Evaluations on a schedule (docs/evals.md): held-out tasks sampled beside training, outside
    the train gate, never trained on. Off while `envs` is empty (the default)."""

    envs: list[str] = Field(default_factory=list, description="envs to evaluate (train envs); empty = no evals")
    every: int = Field(10, ge=1, description="an eval every N published versions, plus version 0 and the last")
    num_tasks: int = Field(32, ge=1, description="held-out tasks per eval (the same ones at every version)")
    samples_per_task: int = Field(4, ge=1, description="samples per task (the k of pass@k)")
    temperature: float = Field(1.0, gt=0, description="sampling temperature of eval episodes")
    max_inflight: int = Field(16, ge=1, description="eval episodes in flight at once (apart from rollout.max_inflight)")

    def core_params(self) -> EvalParams | None:
        if not self.envs:
            return None
        return EvalParams(envs=self.envs, every=self.every, num_tasks=self.num_tasks,
                          samples_per_task=self.samples_per_task, temperature=self.temperature,
                          max_inflight=self.max_inflight)


class LogConfig(_Section):
    durability: Literal["full", "normal"] = Field("full", description="SQLite synchronous=FULL or NORMAL")
    snapshot_every: int = Field(20000, ge=0, description="snapshot the state every N events (0 = never)")


class WandbSection(_Section):
    """Log the run's per-step figures to Weights & Biases (needs `pip install 'orch[wandb]'`)."""

    project: str = Field("orch", description="W&B project")
    entity: str | None = Field(None, description="W&B entity (team or user; None: your default)")
    name: str | None = Field(None, description="W&B run name (None: the orch run's name)")
    mode: Literal["online", "offline", "disabled"] | None = Field(
        None, description="W&B mode (None: WANDB_MODE, else online); offline needs no network")
    dir: Path | None = Field(None, description="where W&B keeps its files (None: WANDB_DIR, else the run dir)")


class TensorBoardSection(_Section):
    """Log the run's per-step figures as TensorBoard scalars."""

    log_dir: Path | None = Field(None, description="TensorBoard log dir (None: RUN_DIR/tensorboard)")


class MetricsConfig(_Section):
    """Metric sinks, off unless their section is given (`--set metrics.tensorboard=true`,
    `--set metrics.wandb.project=NAME`); each is fed the rows of orchestrator/observe/rows.py."""

    wandb: WandbSection | None = Field(None, description="W&B sink (off when absent)")
    tensorboard: TensorBoardSection | None = Field(None, description="TensorBoard sink (off when absent)")

    @model_validator(mode="before")
    @classmethod
    def _switches(cls, data: Any) -> Any:
        """`true` turns a sink on with its defaults, `false` off."""
        if isinstance(data, dict):
            data = {k: ({} if v is True else None if v is False else v) for k, v in data.items()}
        return data


class RunConfig(_Section):
    name: str = Field("default", description="run directory name under runs_dir (`orch run` without --name: run-YYYYmmdd-HHMMSS)")
    runs_dir: Path = Field(Path("runs"), description="where run directories live")
    seed: int = Field(0, description="seeds the core RNG, the envs and the policy")
    max_steps: int = Field(40, ge=1, description="batches to ship, then drain and stop")
    envs: dict[str, float] = Field(
        default_factory=lambda: {"reverse_text": 1.0}, description="train env -> dispatch ratio"
    )
    zero_output_batches: int = Field(10, ge=1, description="batch-equivalents of zero output that stop the run")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="groups, permits and sampling")
    batch: BatchConfig = Field(default_factory=BatchConfig, description="how the pending queue is cut into batches")
    off_policy: OffPolicyConfig = Field(default_factory=OffPolicyConfig, description="how far the rollouts may run ahead of the trainer")
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig, description="how a complete group is scored, inline or in the background")
    fake_env: FakeEnvConfig = Field(default_factory=FakeEnvConfig)
    reverse_text: ReverseTextConfig = Field(default_factory=ReverseTextConfig, description="the `reverse_text` env: reverse a short random string (the embedded job)")
    trainer: TrainerSection = Field(default_factory=TrainerSection, description="the process that trains on the batches and publishes weights")
    log: LogConfig = Field(default_factory=LogConfig, description="the event log (`events.db`)")
    inference: InferenceSection = Field(default_factory=InferenceSection)
    eval: EvalConfig = Field(default_factory=EvalConfig, description="evaluations on a schedule, off by default: docs/evals.md")
    metrics: MetricsConfig = Field(default_factory=MetricsConfig, description="metric sinks (W&B, TensorBoard), off by default: docs/observe.md")
    verifiers: VerifiersSection = Field(default_factory=VerifiersSection, description="the `verifiers` env: a "
                                        "verifiers (v1) taskset, its model calls through inference.endpoints")

    @model_validator(mode="after")
    def _known_envs(self) -> RunConfig:
        unknown = sorted((set(self.envs) | set(self.eval.envs)) - KNOWN_ENVS)
        if unknown:
            raise ValueError(f"unknown env(s) {unknown}; known: {sorted(KNOWN_ENVS)}")
        if self.trainer.kind == "embedded" and set(self.envs) != {"reverse_text"}:
            raise ValueError("the embedded trainer learns reverse_text only; use trainer.kind='fake' for other envs")
        if "verifiers" in self.envs:
            if set(self.envs) != {"verifiers"}:
                raise ValueError("env 'verifiers' runs alone (its episodes come whole from verifiers)")
            if not self.inference.endpoints:
                raise ValueError("env 'verifiers' samples through inference.endpoints (vLLM with --enable-scale-out)")
            if self.eval.envs:
                raise ValueError("evals of env 'verifiers' are not supported yet: its tasksets have no held-out split")
            check_verifiers(self.verifiers)
        elif self.inference.endpoints and set(self.envs) != {"reverse_text"}:
            raise ValueError("inference endpoints sample reverse_text episodes only")
        if self.rollout.env_server is not None and self.eval.envs:
            raise ValueError("evals need held-out tasks (negative indices), which rollout.env_server does not serve; "
                             "run the env in-process for evals")
        if self.rollout.env_server is not None and set(self.envs) != {"reverse_text"}:
            raise ValueError("rollout.env_server serves reverse_text episodes only (the fake env runs in-process)")
        if self.trainer.kind == "fake" and "reverse_text" in self.envs:
            raise ValueError("reverse_text samples from the trainer's published weights, which the fake trainer "
                             "never writes; use trainer.kind='embedded' (or the fake env)")
        try:  # the core's own cross-checks (e.g. an algorithm that must finalize in the background)
            self.core_params()
        except ValidationError as err:
            raise ValueError(_format_validation_error(err).removeprefix("invalid config: ")) from None
        return self

    @property
    def run_dir(self) -> Path:
        return self.runs_dir / self.name

    def finalize_in_background(self) -> bool:
        flag = self.algorithm.finalize_in_background
        return self.algorithm.name in BACKGROUND_ONLY if flag is None else flag

    def core_params(self) -> CoreParams:
        return CoreParams(
            seed=self.seed, env_ratios=self.envs, group_size=self.rollout.group_size,
            batch_size=self.batch.size, token_batch_size=self.batch.token_size,
            constant_trainer_batch_size=self.batch.constant_trainer_batch_size,
            max_inflight=self.rollout.max_inflight, target_lag=self.off_policy.target_lag,
            max_off_policy_steps=self.off_policy.max_off_policy_steps,
            max_finalizing_groups=self.algorithm.max_finalizing_groups, max_steps=self.max_steps,
            algorithm=self.algorithm.name, finalize_in_background=self.finalize_in_background(),
            zero_output_batches=self.zero_output_batches, capacity=self.rollout.capacity,
            eval=self.eval.core_params(),
        )

    def to_json(self) -> bytes:
        return orjson.dumps(self.model_dump(mode="json"), option=orjson.OPT_SORT_KEYS)


KNOWN_ENVS = frozenset({"reverse_text", "fake", "verifiers"})

# Fields a resume may change: they alter how the run is operated, not what it computes.
RESUMABLE_FIELDS = frozenset({
    "max_steps", "runs_dir", "name", "log.durability", "log.snapshot_every", "trainer.publish_timeout_s", "trainer.step_time_s",
    "trainer.exit_timeout_s", "rollout.env_server",
    "trainer.nproc", "trainer.ddp_backend", "inference.endpoints", "inference.request_timeout_s",
    "inference.max_attempts", "inference.backoff_s", "inference.max_backoff_s", "inference.pin_groups",
    "verifiers.path", "verifiers.rollout_timeout_s", "verifiers.setup_timeout_s", "verifiers.scoring_timeout_s",
})
RESUMABLE_SECTIONS = frozenset({"metrics"})  # every field inside them may change on resume


# Fields added after runs were first written, with the value a stored config that lacks one
# means: the behaviour its run was recorded with (its log says the same).
ADDED_FIELDS = {("rollout", "capacity"): "off"}


def with_added_fields(stored: dict) -> dict:
    """A stored config (JSON) with every field it predates set to what its run did."""
    upgraded = copy.deepcopy(stored)
    for (section, name), value in ADDED_FIELDS.items():
        node = upgraded.setdefault(section, {})
        if isinstance(node, dict):
            node.setdefault(name, value)
    return upgraded


def config_hash(config_json: bytes) -> str:
    return hashlib.sha256(config_json).hexdigest()


def _format_validation_error(err: ValidationError) -> str:
    parts = []
    for item in err.errors():
        message = item["msg"].removeprefix("Value error, ")  # a validator's own message
        where = ".".join(str(x) for x in item["loc"])
        parts.append(f"{where}: {message}" if where else message)
    return "invalid config: " + "; ".join(parts)


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b=value` -> (["a", "b"], value); the value is JSON if it parses, else a string."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set expects KEY=VALUE (e.g. batch.size=64), got {text!r}")
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError:
        value = raw
    return key.strip().split("."), value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    for text in overrides:
        path, value = parse_override(text)
        _set_path(data, path, value, f"--set {text!r}")
    return data


def _set_path(data: dict, path: list[str], value: Any, source: str) -> None:
    node = data
    for part in path[:-1]:
        if node.get(part) is None:  # absent, or an optional section that is off (metrics.wandb)
            node[part] = {}
        child = node[part]
        if not isinstance(child, dict):
            raise ConfigError(f"{source}: {part!r} is not a section")
        node = child
    node[path[-1]] = value


def load_config(path: Path | None = None, overrides: list[str] = (), base: dict | None = None) -> RunConfig:
    """`base` (e.g. a resumed run's stored config; else the defaults), with the TOML file's
    values laid over it, then the `--set` overrides."""
    data: dict = copy.deepcopy(base or {})
    if path is not None:
        for name, value in _flatten(_read_toml(path)).items():
            _set_path(data, name.split("."), value, f"config file {path}")
    apply_overrides(data, list(overrides))
    try:
        return RunConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err)) from None


def _read_toml(path: Path) -> dict:
    try:
        return tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"config file {path} is not UTF-8 text ({err.reason} at byte {err.start})") from None
    except OSError as err:
        raise ConfigError(f"cannot read config file {path}: {err.strerror}") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"config file {path} is not valid TOML: {err}") from None


def _flatten(data: dict, prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and key != "envs":
            flat.update(_flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def meaning_changes(stored: RunConfig, requested: RunConfig) -> list[str]:
    """Fields that differ between two configs and would change what the run computes."""
    old = _flatten(stored.model_dump(mode="json"))
    new = _flatten(requested.model_dump(mode="json"))
    return sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k) and k not in RESUMABLE_FIELDS
                  and k.partition(".")[0] not in RESUMABLE_SECTIONS)
