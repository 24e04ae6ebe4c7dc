"""The composition root of a run's configuration: the component registries, `RunConfig` (one
pydantic model, loadable from TOML, with dotted `--set` overrides) and the rules between components.

Every knob of the rules (docs/rules.md) is a field here with a documented default; `core_params()` extracts the
part the core folds (it travels in `run_started`, so a log is self-describing). The components'
sections come from the registries below: `trainer.<kind>`, `inference.<kind>`, `env.<name>` and
`algorithm.<name>`, each the component's own config model (`orchestrator.contracts`), which also
checks what the component supports; the rules that span components (a synthetic env refused by
the model's samplers and trainers, a sampler of published weights beside a trainer that writes
them) are checked here.
"""

from __future__ import annotations

import copy
import difflib
import hashlib
import tomllib
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import orjson
from pydantic import (
    AfterValidator,
    BaseModel,
    Field,
    PrivateAttr,
    TypeAdapter,
    ValidationError,
    create_model,
    field_validator,
    model_serializer,
    model_validator,
)

from orchestrator.contracts import (
    AlgorithmComponent,
    BuildContext,
    Component,
    ConfigError,
    EnvComponent,
    InferenceComponent,
    ModelRequest,
    PreparedModel,
    RunPlan,
    Sampling,
    StartedEarly,
    TextEnv,
    TrainerComponent,
)
from orchestrator.contracts import Section as _Section
from orchestrator.core.events import CoreParams, EvalParams
from orchestrator.placement import LOCAL, Placement, PlacementError, slurm_placement
from orchestrator.plugins import installed_names, resolve, resolve_sink


# -------------------------------------------------------------------------------------- registries
class Registry:
    """The components of one kind: a built-in table `name -> "module:Config"`, plus what
    `orchestrator.plugins.resolve` finds for any other name (an installed package's entry point,
    a `module:Attribute`); a config model is imported when first asked for."""

    def __init__(self, kind: str, table: Mapping[str, str], base: type[Component] = Component):
        self.kind, self.base, self._table = kind, base, dict(table)
        self._loaded: dict[str, type[Component]] = {}

    def names(self) -> list[str]:
        """The built-in names (a plugin is not listed: it is found when asked for)."""
        return sorted(self._table)

    def module(self, name: str) -> str:
        """The module that holds built-in `name`'s config model."""
        self.known(name)
        return self._table[name].partition(":")[0]

    def known(self, name: str) -> str:
        """`name`, if it resolves to a component of this kind (else a one-line PluginError, a
        ValueError, saying what was asked and what was found)."""
        self.config(name)
        return name

    def config(self, name: str) -> type[Component]:
        """The config model of `name` (PluginError, one line, if there is none or it is no
        component of this kind)."""
        if name not in self._loaded:
            self._loaded[name] = resolve(self.kind, name, self._table, self.base)
        return self._loaded[name]

    def configs(self) -> dict[str, type[Component]]:
        """The built-in components' config models."""
        return {name: self.config(name) for name in self.names()}


TRAINERS = Registry(
    "trainer",
    {
        "fake": "orchestrator.trainers.fake:FakeTrainerConfig",
        "hf": "orchestrator.hf.component:HFTrainerConfig",
    },
    TrainerComponent,
)
INFERENCE = Registry(
    "inference backend",
    {
        "embedded": "orchestrator.embedded.sampler_backend:EmbeddedSamplerConfig",
        "openai": "orchestrator.inference.component:OpenAIConfig",
        "fake": "orchestrator.inference.fake:FakeEpisodesConfig",
    },
    InferenceComponent,
)
ENVS = Registry(
    "env",
    {
        "reverse_text": "orchestrator.envs.reverse_text:ReverseTextConfig",
        "fake": "orchestrator.envs.fake:FakeEnvConfig",
        "verifiers": "orchestrator.verifiers.component:VerifiersConfig",
        "dataset": "orchestrator.envs.dataset:DatasetConfig",
        "reasoning_gym": "orchestrator.envs.reasoning_gym:ReasoningGymConfig",
        "nemo_gym": "orchestrator.nemo_gym.component:NemoGymConfig",
    },
    EnvComponent,
)
ALGORITHMS = Registry(
    "algorithm",
    {
        "grpo": "orchestrator.algorithms.grpo:GRPOConfig",
        "gar": "orchestrator.algorithms.gar:GARConfig",
    },
    AlgorithmComponent,
)


def served_env(name: str, seed: int = 0, **settings: Any) -> TextEnv:
    """Env `name` of the registry as `orch env-server` hosts it: its section with `settings`, its
    tasks for `seed` (ValueError, one line, for an unknown env, one that cannot be served, or bad
    settings)."""
    try:
        section = ENVS.config(name).model_validate(settings)
    except ValidationError as err:
        raise ValueError(_format_validation_error(err).removeprefix("invalid config: ")) from None
    env = section.text_env(seed)
    if env is None:
        servable = [n for n, model in ENVS.configs().items() if model().text_env(seed) is not None]
        raise ValueError(f"env {name!r} cannot be served by an env server; these can: {', '.join(servable)}")
    return env


# ------------------------------------------------------------------------ rules between components
def synthetic_envs(run: RunConfig) -> list[str]:
    """The run's envs whose episodes are not the model's tokens (`EnvComponent.synthetic`)."""
    return [name for name in run.envs if ENVS.config(name).synthetic]


def refuse_synthetic_envs(component: TrainerComponent | InferenceComponent, run: RunConfig) -> None:
    """A component of the model (a sampler or trainer of its tokens) refuses synthetic envs."""
    synthetic = synthetic_envs(run)
    if synthetic and component.refuses_synthetic is not None:
        raise ValueError(component.refuses_synthetic.format(envs=", ".join(synthetic)))


def refuse_loss_options_of_another_trainer(run: RunConfig) -> None:
    """`trainer.hf.loss` is the hf trainer's: with another trainer it would be silently ignored."""
    hf = getattr(run.trainer, "hf", None)
    loss_set = hf.loss.model_dump(exclude_defaults=True) if hf is not None and run.trainer.kind != "hf" else {}
    if loss_set:
        raise ValueError(
            f"trainer.hf.loss.{next(iter(loss_set))} is an option of the hf trainer; "
            f"trainer.kind={run.trainer.kind!r} has no loss"
        )


def check_samples_published_weights(backend: InferenceComponent, trainer: TrainerComponent, kind: str) -> None:
    """A sampler of the trainer's published weights needs a trainer that writes them."""
    if backend.follows_weights and not trainer.writes_weights:
        writers = [name for name, model in TRAINERS.configs().items() if model.writes_weights]
        raise ValueError(
            f"{backend.sampler} samples from the trainer's published weights, which the {kind} "
            f"trainer never writes; use trainer.kind={' or '.join(map(repr, writers))} (or the fake env)"
        )


def check_pushed_weights(backend: InferenceComponent, trainer: TrainerComponent, kind: str) -> None:
    """A sampler whose servers take pushed versions needs a trainer that pushes them."""
    if backend.pulls_pushed_weights() and (refusal := trainer.push_refusal(backend.pushed_transport())) is not None:
        raise ValueError(
            f"{backend.sampler} takes each version pushed from the trainer (weight_sync 'vllm_push'), "
            f"which the {kind} trainer cannot do: {refusal}"
        )


class RolloutConfig(_Section):
    group_size: int = Field(8, ge=1, description="episodes per group (one task)")
    max_inflight: int = Field(128, ge=1, description="in-flight episode permits (a hard cap, capacity or not)")
    capacity: Literal["staleness", "off"] = Field(
        "staleness",
        description="staleness: start a group only while the work dispatched and not yet shipped or "
        "dropped can still train before it is too old (docs/rules.md, the dispatch capacity); off: max_inflight alone",
    )
    temperature: float = Field(1.0, gt=0, description="sampling temperature of train episodes, whatever the backend")
    max_new_tokens: int = Field(
        48,
        ge=1,
        description="completion length cap of every sampling call, whatever the backend "
        "(reverse_text's answers need <= 38)",
    )

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, data: Any) -> Any:
        if isinstance(data, dict) and "env_server" in data:
            raise ValueError("env_server is now env.reverse_text.server (the reverse_text env's own setting)")
        return data


class BatchConfig(_Section):
    size: int = Field(128, ge=1, description="samples per batch")
    token_size: int | None = Field(None, ge=1, description="if set, batch by tokens instead of samples")
    constant_trainer_batch_size: bool = Field(False, description="prune zero-advantage samples before the cut")
    cut: Literal["prefix", "groups"] = Field(
        "groups",
        description="groups: whole groups only, at most `size` samples (docs/rules.md, Samples); prefix: the "
        "oldest `size` samples (a group may split at the edge; the default with constant_trainer_batch_size)",
    )
    sample_weight: Literal["episode", "sample"] = Field(
        "episode",
        description="loss weight of each sample: episode: 1/N for an episode's N samples; sample: 1 each",
    )

    @model_validator(mode="before")
    @classmethod
    def _full_batches_cut_by_prefix(cls, data: Any) -> Any:
        """constant_trainer_batch_size keeps every batch full, which only the prefix cut can: it
        is that setting's default cut."""
        if isinstance(data, dict) and "cut" not in data:
            try:  # as the field reads it ("false" is False); a value it refuses, it reports
                full = TypeAdapter(bool).validate_python(data.get("constant_trainer_batch_size", False))
            except ValidationError:
                full = False
            if full:
                return {**data, "cut": "prefix"}
        return data

    @model_validator(mode="after")
    def _cut_keeps_batches_full(self) -> BatchConfig:
        if self.constant_trainer_batch_size and self.cut == "groups":
            raise ValueError(
                "batch.constant_trainer_batch_size keeps every batch full, which batch.cut='groups' cannot: "
                "set batch.cut='prefix'"
            )
        return self


class OffPolicyConfig(_Section):
    target_lag: int = Field(1, ge=0, description="batch N ships once the trainer published N-1-target_lag")
    max_off_policy_steps: int = Field(2, ge=0, description="oldest usable policy: (step-1) - this")


class _Components(_Section):
    """The sections of one kind's components: a built-in one's as a field; a plugin's (a name an
    installed package's entry point registers, or a `module:Attribute`) validated by its own
    config model, held beside the fields and written with them (so a run's stored config has it)."""

    _registry: ClassVar[Registry]
    _plugins: dict[str, Component] = PrivateAttr(default_factory=dict)

    @classmethod
    def _is_plugin(cls, name: str) -> bool:
        return name not in cls.model_fields and (":" in name or name in installed_names(cls._registry.kind))

    @model_validator(mode="wrap")
    @classmethod
    def _plugin_sections(cls, data: Any, handler: Any) -> Any:
        plugins: dict[str, Component] = {}
        if isinstance(data, dict):
            data = dict(data)
            for name in [key for key in data if cls._is_plugin(key)]:
                settings = data.pop(name)
                model = cls._registry.config(name)
                try:
                    plugins[name] = settings if isinstance(settings, model) else model.model_validate(settings or {})
                except ValidationError as err:
                    raise ValueError(_format_validation_error(err, name).removeprefix("invalid config: ")) from None
        sections = handler(data)
        sections._plugins.update(plugins)
        return sections

    @model_serializer(mode="wrap")
    def _dump_plugin_sections(self, handler: Any, info: Any) -> Any:
        data = handler(self)
        for name, section in self._plugins.items():
            data[name] = section.model_dump(mode=info.mode)
        return data

    def section(self, name: str) -> Component:
        """Component `name`'s section: its field, or a plugin's (its defaults if none was given,
        kept from now on, so the stored config names them)."""
        if name in type(self).model_fields:
            return getattr(self, name)
        if name not in self._plugins:
            self._plugins[name] = self._registry.config(name)()
        return self._plugins[name]


def _with_components(name: str, base: type[_Components], registry: Registry) -> type[_Components]:
    """`base` with one field per built-in component of `registry`: its config section."""
    fields: dict[str, Any] = {
        component: (model, Field(default_factory=model, description=(model.__doc__ or "").strip().splitlines()[0]))
        for component, model in registry.configs().items()
    }
    sections = create_model(name, __base__=base, **fields)
    sections._registry = registry
    return sections


def _name_in(registry: Registry, *, optional: bool = False) -> Any:
    """A field holding the name of one of `registry`'s components (else a one-line error), or
    None if `optional`."""
    if optional:
        return Annotated[str | None, AfterValidator(lambda name: None if name is None else registry.known(name))]
    return Annotated[str, AfterValidator(registry.known)]


class _AlgorithmChoice(_Components):
    name: _name_in(ALGORITHMS) = Field("grpo", description="the algorithm: " + ", ".join(ALGORITHMS.names()))
    finalize_in_background: bool | None = Field(None, description="override the algorithm's class flag")
    max_finalizing_groups: int = Field(64, ge=1, description="finalizing groups per env that close the gate")

    def chosen(self) -> AlgorithmComponent:
        return self.section(self.name)


class ModelSection(_Section):
    """The model a run trains and samples: a local Hugging Face model dir or a Hub id."""

    path: Path | None = Field(
        None,
        description="a local Hugging Face model dir (config.json, weights, tokenizer), or a Hub id "
        "(owner/name) found in the Hugging Face cache, offline first (docs/hf.md); "
        "None: the tiny reverse_text model, built locally once and cached under "
        "runs_dir/.cache (`orch tiny-model DIR` builds it anywhere)",
    )
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description='extra variables of the chat template (e.g. Qwen3\'s {"enable_thinking": false})',
    )


class _TrainerChoice(_Components):
    kind: _name_in(TRAINERS) = Field("hf", description="the trainer: " + ", ".join(TRAINERS.names()))
    publish_timeout_s: float = Field(300.0, gt=0, description="max wait for the trainer's next version")
    exit_timeout_s: float = Field(30.0, gt=0, description="max wait for the trainer to exit at the end")
    max_restarts: int = Field(
        2,
        ge=0,
        description="a trainer process killed or crashed is restarted from its checkpoint this many times "
        "(each a trainer_restarted event), then the run stops",
    )

    def chosen(self) -> TrainerComponent:
        return self.section(self.kind)


class _InferenceChoice(_Components):
    kind: _name_in(INFERENCE, optional=True) = Field(
        None,
        description="the sampler: " + ", ".join(INFERENCE.names()) + " (None: fake for the fake env, openai "
        "when inference.openai.endpoints, routers or launch.servers is set, else embedded)",
    )


AlgorithmConfig = _with_components("AlgorithmConfig", _AlgorithmChoice, ALGORITHMS)
TrainerSection = _with_components("TrainerSection", _TrainerChoice, TRAINERS)
InferenceSection = _with_components("InferenceSection", _InferenceChoice, INFERENCE)
EnvSection = _with_components("EnvSection", _Components, ENVS)


class EvalConfig(_Section):
    """Evaluations on a schedule (docs/evals.md): held-out tasks sampled beside training, outside
    the train gate, never trained on. Off while `envs` is empty (the default)."""

    envs: list[str] = Field(default_factory=list, description="envs to evaluate (train envs); empty = no evals")
    every: int = Field(10, ge=1, description="an eval every N published versions, plus version 0 and the last")
    num_tasks: int = Field(32, ge=1, description="held-out tasks per eval (the same ones at every version)")
    samples_per_task: int = Field(4, ge=1, description="samples per task (the k of pass@k)")
    temperature: float = Field(1.0, gt=0, description="sampling temperature of eval episodes")
    max_inflight: int = Field(16, ge=1, description="eval episodes in flight at once (apart from rollout.max_inflight)")

    @field_validator("envs")
    @classmethod
    def _known_envs(cls, envs: list[str]) -> list[str]:
        for name in envs:
            ENVS.known(name)
        return envs

    def core_params(self) -> EvalParams | None:
        if not self.envs:
            return None
        return EvalParams(
            envs=self.envs,
            every=self.every,
            num_tasks=self.num_tasks,
            samples_per_task=self.samples_per_task,
            temperature=self.temperature,
            max_inflight=self.max_inflight,
        )


class LogConfig(_Section):
    durability: Literal["full", "normal"] = Field("full", description="SQLite synchronous=FULL or NORMAL")
    snapshot_every: int = Field(20000, ge=0, description="snapshot the state every N events (0 = never)")
    batch_files: Literal["until_trained", "keep"] = Field(
        "until_trained",
        description="until_trained: batches/step_N.safetensors is removed once version N is published (the "
        "trainer checkpoints a step before it publishes it; a resume re-writes from the log any batch not "
        "trained yet); keep: every batch file stays (the log holds what they hold either way)",
    )
    token_arrays: Literal["keep", "until_trained"] = Field(
        "keep",
        description="keep: every episode's token ids, mask and logprobs stay in the log (about 8.2 bytes per "
        "token logged, the whole record: orch replay --episode, --check and --reexecute read them); "
        "until_trained: an episode's arrays are dropped once no resume can need them (its samples trained on "
        "by a published version, or dropped), each row keeping their sha256; the replays that need them "
        "refuse in one line",
    )


class WandbSection(_Section):
    """Log the run's per-step figures to Weights & Biases (needs `pip install 'orch[wandb]'`)."""

    project: str = Field("orch", description="W&B project")
    entity: str | None = Field(None, description="W&B entity (team or user; None: your default)")
    name: str | None = Field(None, description="W&B run name (None: the orch run's name)")
    mode: Literal["online", "offline", "disabled"] | None = Field(
        None, description="W&B mode (None: WANDB_MODE, else online); offline needs no network"
    )
    dir: Path | None = Field(None, description="where W&B keeps its files (None: WANDB_DIR, else the run dir)")


class TensorBoardSection(_Section):
    """Log the run's per-step figures as TensorBoard scalars."""

    log_dir: Path | None = Field(None, description="TensorBoard log dir (None: RUN_DIR/tensorboard)")


class MetricsConfig(_Section):
    """Metric sinks, off unless their section is given (`--set metrics.tensorboard=true`,
    `--set metrics.wandb.project=NAME`); each is fed the rows of orchestrator/observe/rows.py."""

    wandb: WandbSection | None = Field(None, description="W&B sink (off when absent)")
    tensorboard: TensorBoardSection | None = Field(None, description="TensorBoard sink (off when absent)")
    plugins: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="sinks of your own package: name (an entry point of orch.metric_sinks) or "
        "module:Attribute -> its settings (docs/plugins.md)",
    )
    samples_per_step: int = Field(
        4,
        ge=0,
        description="sample completions per shipped step shown by the sinks that show text (a TensorBoard "
        "text table, a W&B table): the batch's first, decoded with the run's tokenizer; 0: none",
    )

    @field_validator("plugins")
    @classmethod
    def _sinks_load(cls, plugins: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        for name in plugins:
            resolve_sink(name)
        return plugins

    @model_validator(mode="before")
    @classmethod
    def _switches(cls, data: Any) -> Any:
        """`true` turns a sink on with its defaults, `false` off."""
        if isinstance(data, dict):
            data = {k: ({} if v is True else None if v is False else v) for k, v in data.items()}
        return data


class SlurmSection(_Section):
    """The `slurm` placement: the run's servers and trainer as job steps of the allocation `orch
    run` runs in (docs/scaling-out.md, "Under SLURM")."""

    nodes: list[str] = Field(
        default_factory=list,
        description="the allocation's nodes, in order (empty: SLURM_JOB_NODELIST, expanded by scontrol)",
    )
    inference_nodes: list[int] = Field(
        default_factory=lambda: [0],
        description="indices into `nodes` of the nodes the vLLM servers run on, one server after another "
        "(server K on inference_nodes[K % len])",
    )
    trainer_nodes: list[int] = Field(
        default_factory=lambda: [0],
        description="indices into `nodes`, one per torchrun node of the trainer (a node listed twice runs two; "
        "each node listed the same number of times)",
    )
    rdzv_port: int = Field(29400, gt=0, lt=65536, description="the trainer's c10d rendezvous port, on its first node")
    job_id: str | None = Field(None, description="the allocation whose steps these are (None: SLURM_JOB_ID)")

    @model_validator(mode="after")
    def _nodes_listed_evenly(self) -> SlurmSection:
        if not self.inference_nodes or not self.trainer_nodes:
            raise ValueError("slurm.inference_nodes and slurm.trainer_nodes each need at least one node")
        if min(self.inference_nodes + self.trainer_nodes) < 0:
            raise ValueError("slurm.inference_nodes and slurm.trainer_nodes are indices into slurm.nodes: 0 or more")
        counts = {self.trainer_nodes.count(node) for node in self.trainer_nodes}
        if len(counts) > 1:
            raise ValueError(
                f"slurm.trainer_nodes {self.trainer_nodes} lists its nodes unevenly: srun runs as many "
                "torchrun nodes on each"
            )
        return self


class RunConfig(_Section):
    name: str = Field(
        "default", description="run directory name under runs_dir (`orch run` without --name: run-YYYYmmdd-HHMMSS)"
    )
    runs_dir: Path = Field(Path("runs"), description="where run directories live")
    seed: int = Field(0, description="seeds the core RNG, the envs and the policy")
    max_steps: int = Field(40, ge=1, description="batches to ship, then drain and stop")
    envs: dict[str, float] = Field(
        default_factory=lambda: {"reverse_text": 1.0}, description="train env -> dispatch ratio"
    )
    zero_output_batches: int = Field(10, ge=1, description="batch-equivalents of zero output that stop the run")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="groups, permits and sampling")
    batch: BatchConfig = Field(default_factory=BatchConfig, description="how the pending queue is cut into batches")
    off_policy: OffPolicyConfig = Field(
        default_factory=OffPolicyConfig, description="how far the rollouts may run ahead of the trainer"
    )
    algorithm: AlgorithmConfig = Field(
        default_factory=AlgorithmConfig,
        description="how a complete group is scored, "
        "inline or in the background; `algorithm.<name>`: each algorithm's own settings",
    )
    env: EnvSection = Field(
        default_factory=EnvSection,
        description="each env's own settings (`env.<name>`; `envs` picks the ones a run uses)",
    )
    model: ModelSection = Field(
        default_factory=ModelSection, description="the Hugging Face model dir the run trains and samples: docs/hf.md"
    )
    trainer: TrainerSection = Field(
        default_factory=TrainerSection,
        description="the process that trains on the "
        "batches and publishes weights; `trainer.<kind>`: each trainer's own settings",
    )
    log: LogConfig = Field(default_factory=LogConfig, description="the event log (`events.db`)")
    inference: InferenceSection = Field(
        default_factory=InferenceSection,
        description="the sampler of the episodes; `inference.<kind>`: each backend's own settings",
    )
    eval: EvalConfig = Field(
        default_factory=EvalConfig, description="evaluations on a schedule, off by default: docs/evals.md"
    )
    metrics: MetricsConfig = Field(
        default_factory=MetricsConfig, description="metric sinks (W&B, TensorBoard), off by default: docs/observe.md"
    )
    placement: Literal["local", "slurm"] = Field(
        "local",
        description="where the vLLM servers and the trainer orch starts run: local children of orch run, or "
        "job steps (srun) of the SLURM allocation orch run runs in (the `slurm` section; docs/scaling-out.md)",
    )
    slurm: SlurmSection = Field(
        default_factory=SlurmSection, description="the slurm placement's layout: which nodes serve, which train"
    )

    @field_validator("envs")
    @classmethod
    def _known_envs(cls, envs: dict[str, float]) -> dict[str, float]:
        for name in envs:
            ENVS.known(name)
        return envs

    @model_validator(mode="after")
    def _components_support_the_run(self) -> RunConfig:
        """Each component checks what it supports (the sampler first: what it samples decides
        which other combinations make sense), after the rules between components that concern it."""
        plan = self.plan()
        backend, trainer = self.inference_backend(), self.trainer.chosen()
        refuse_synthetic_envs(backend, self)
        backend.check(plan)
        check_samples_published_weights(backend, trainer, self.trainer.kind)
        check_pushed_weights(backend, trainer, self.trainer.kind)
        refuse_synthetic_envs(trainer, self)
        refuse_loss_options_of_another_trainer(self)
        trainer.check(plan)
        for env in self.env_components().values():
            env.check(plan)
        self.algorithm.chosen().check(plan)
        try:  # the core's own cross-checks (e.g. an algorithm that must finalize in the background)
            self.core_params()
        except ValidationError as err:
            raise ValueError(_format_validation_error(err).removeprefix("invalid config: ")) from None
        return self

    @property
    def run_dir(self) -> Path:
        return self.runs_dir / self.name

    def inference_kind(self) -> str:
        if self.inference.kind is not None:
            return self.inference.kind
        if self.inference.openai.enabled:
            return "openai"
        return "fake" if set(self.envs) == {"fake"} else "embedded"

    def inference_backend(self) -> InferenceComponent:
        return self.inference.section(self.inference_kind())

    def env_components(self) -> dict[str, EnvComponent]:
        return {name: self.env.section(name) for name in self.envs}

    def plan(self) -> RunPlan:
        """What the run is made of, as a component's `check` sees it."""
        return RunPlan(
            envs=tuple(self.envs),
            eval_envs=tuple(self.eval.envs),
            inference=self.inference_kind(),
            requests_in_flight=self.rollout.max_inflight + (self.eval.max_inflight if self.eval.envs else 0),
            finalize_in_background=self.finalize_in_background(),
            placement=self.placement,
        )

    def model_request(self) -> ModelRequest:
        """The model dir a trainer's `prepare_model` checks: the `model` section's, for the run's envs."""
        return ModelRequest(
            path=self.model.path,
            cache_dir=self.runs_dir / ".cache",
            env_gives_messages=any(env.gives_messages for env in self.env_components().values()),
            weights_pushed=self.inference_backend().pulls_pushed_weights(),
        )

    def placement_of(self) -> Placement:
        """Where the servers and the trainer orch starts run (ConfigError: one line, where this
        machine cannot place them so)."""
        if self.placement == "local":
            return LOCAL
        slurm = self.slurm
        try:
            return slurm_placement(
                slurm.nodes,
                slurm.inference_nodes,
                slurm.trainer_nodes,
                slurm.rdzv_port,
                slurm.job_id,
                self.inference_backend().launched_gpus(),
            )
        except PlacementError as err:
            raise ConfigError(str(err)) from None

    def build_context(
        self,
        run_dir: Path,
        version_now: Callable[[], int],
        model: PreparedModel | None = None,
        started_early: StartedEarly | None = None,
    ) -> BuildContext:
        """What every factory gets besides its own section."""
        return BuildContext(
            run_dir=run_dir,
            seed=self.seed,
            max_steps=self.max_steps,
            sampling=Sampling(
                temperature=self.rollout.temperature,
                max_new_tokens=self.rollout.max_new_tokens,
                chat_template_kwargs=self.model.chat_template_kwargs,
            ),
            version_now=version_now,
            publish_timeout_s=self.trainer.publish_timeout_s,
            # The trainer may publish up to target_lag + 1 versions the log has not recorded yet (a
            # crash); a resume reloads the newest recorded one, which must still be on disk.
            kept_versions=self.off_policy.target_lag + 2,
            max_restarts=self.trainer.max_restarts,
            model=model,
            started_early=started_early,
            served_model=self.inference_backend().served_model(),
            weights_pushed=self.inference_backend().pulls_pushed_weights(),
            push_transport=self.inference_backend().pushed_transport(),
            placement=self.placement_of(),
            env_sections=self.env_components(),
        )

    def finalize_in_background(self) -> bool:
        flag = self.algorithm.finalize_in_background
        return self.algorithm.chosen().finalize_in_background if flag is None else flag

    def core_params(self) -> CoreParams:
        return CoreParams(
            seed=self.seed,
            env_ratios=self.envs,
            group_size=self.rollout.group_size,
            batch_size=self.batch.size,
            token_batch_size=self.batch.token_size,
            constant_trainer_batch_size=self.batch.constant_trainer_batch_size,
            max_inflight=self.rollout.max_inflight,
            target_lag=self.off_policy.target_lag,
            max_off_policy_steps=self.off_policy.max_off_policy_steps,
            max_finalizing_groups=self.algorithm.max_finalizing_groups,
            max_steps=self.max_steps,
            algorithm=self.algorithm.name,
            finalize_in_background=self.finalize_in_background(),
            **self.algorithm.chosen().core_settings(),
            zero_output_batches=self.zero_output_batches,
            capacity=self.rollout.capacity,
            batch_cut=self.batch.cut,
            sample_weight=self.batch.sample_weight,
            eval=self.eval.core_params(),
        )

    def to_json(self) -> bytes:
        return orjson.dumps(self.model_dump(mode="json"), option=orjson.OPT_SORT_KEYS)


def _resumable_fields() -> frozenset[str]:
    """Fields a resume may change: they alter how the run is operated, not what it computes
    (each component names its own)."""
    fields = {
        "max_steps",
        "runs_dir",
        "name",
        "log.durability",
        "log.snapshot_every",
        "log.batch_files",
        "log.token_arrays",
        "trainer.publish_timeout_s",
        "trainer.exit_timeout_s",
        "trainer.max_restarts",
        "inference.kind",
        "placement",
    }
    for section, registry in (
        ("trainer", TRAINERS),
        ("inference", INFERENCE),
        ("env", ENVS),
        ("algorithm", ALGORITHMS),
    ):
        for name, model in registry.configs().items():
            fields.update(f"{section}.{name}.{field}" for field in model.resumable)
    return frozenset(fields)


RESUMABLE_FIELDS = _resumable_fields()
# Sections every field inside which may change on resume: the metric sinks, how the run's vLLM
# servers are started and how a version travels to them (not what they compute).
RESUMABLE_SECTIONS = frozenset({"metrics", "inference.openai.launch", "trainer.hf.push", "slurm"})


def resumable(key: str) -> bool:
    """A resume may change the field at dotted `key`."""
    return key in RESUMABLE_FIELDS or any(key.startswith(section + ".") for section in RESUMABLE_SECTIONS)


def config_hash(config_json: bytes) -> str:
    return hashlib.sha256(config_json).hexdigest()


def _format_validation_error(err: ValidationError, within: str | None = None) -> str:
    """One line; `within`: the section the error's locations are in (a plugin's, `name.field`)."""
    parts = []
    for item in err.errors():
        message = item["msg"].removeprefix("Value error, ")  # a validator's own message
        where = ".".join(str(x) for x in ((within,) if within else ()) + tuple(item["loc"]))
        if item["type"] == "extra_forbidden":
            nearest = nearest_key(where)
            message = f"no such key{f' (did you mean {nearest}?)' if nearest else ''}"
        parts.append(f"{where}: {message}" if where else message)
    return "invalid config: " + "; ".join(parts)


def config_keys(model: type[BaseModel] | None = None, prefix: str = "") -> list[str]:
    """Every dotted key of the config (sections and their fields), as `--set` takes them."""
    keys = []
    for name, info in (model or RunConfig).model_fields.items():
        key = f"{prefix}{name}"
        keys.append(key)
        for kind in (info.annotation, *typing.get_args(info.annotation)):
            if isinstance(kind, type) and issubclass(kind, BaseModel):
                keys.extend(config_keys(kind, key + "."))
                break
    return keys


def nearest_key(unknown: str) -> str | None:
    """The config key an unknown one most likely meant: a misspelt name in the same section,
    else a key of the same name in another section (`trainer.lora` for `trainer.hf.lora`)."""
    keys = config_keys()
    section, _, name = unknown.rpartition(".")
    siblings = {key.rpartition(".")[2]: key for key in keys if key.rpartition(".")[0] == section}
    close = difflib.get_close_matches(name, list(siblings), n=1, cutoff=0.6)
    if close:
        return siblings[close[0]]
    same_name = [key for key in keys if key.rpartition(".")[2] == name]
    close = difflib.get_close_matches(unknown, same_name, n=1, cutoff=0.0)
    return close[0] if close else None


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b=value` -> (["a", "b"], value); the value is JSON if it parses, else a string."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set expects KEY=VALUE (e.g. batch.size=64), got {text!r}")
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError:
        value = raw
    return config_path(key.strip()), value


def config_path(key: str) -> list[str]:
    """A dotted key's parts; a `module:Attribute` component name (`env.my_pkg.tasks:Env.size`) is
    one part, from after the section that holds it up to its colon's part."""
    parts = key.split(".")
    named = next((i for i, part in enumerate(parts) if ":" in part), None)
    if named is None or named == 0:
        return parts
    sections = set(config_keys())
    start = max(j for j in range(1, named + 1) if j == 1 or ".".join(parts[:j]) in sections)
    return [*parts[:start], ".".join(parts[start : named + 1]), *parts[named + 1 :]]


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
        for name, value in _flatten_paths(_read_toml(path)).items():
            _set_path(data, list(name), value, f"config file {path}")
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


def _flatten_paths(data: dict, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    flat = {}
    for key, value in data.items():
        path = (*prefix, key)
        if isinstance(value, dict) and key != "envs":
            flat.update(_flatten_paths(value, path))
        else:
            flat[path] = value
    return flat


def _flatten(data: dict) -> dict[str, Any]:
    return {".".join(path): value for path, value in _flatten_paths(data).items()}


def meaning_changes(stored: RunConfig, requested: RunConfig) -> list[str]:
    """Fields that differ between two configs and would change what the run computes."""
    old = _flatten(stored.model_dump(mode="json"))
    new = _flatten(requested.model_dump(mode="json"))
    return sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k) and not resumable(k))
