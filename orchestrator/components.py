"""Components chosen by name: trainers, inference backends, envs and algorithms.

Each kind has one interface (a Protocol below) and a registry: a table `name -> "module:Config"`
pointing to the component's config model. The config model is the component as the wiring sees
it: its config section (a field of `RunConfig`, e.g. `trainer.hf.lr`), what it supports
(`check`, run while the config is validated: a bad combination is a one-line error before anything
runs) and its factory (`build`/`open`, which imports the heavy parts, torch or httpx, only then).
So a config module must stay light: pydantic and the stdlib, never torch, httpx or
`orchestrator.config` (which imports it); the factory imports the rest inside `build`.

Adding a component is adding a module and one line of its kind's table. E.g. a trainer `hf` (the
real one, orchestrator/hf/config.py, has more settings):

    # orchestrator/hf/config.py
    class HFTrainerConfig(TrainerComponent):
        '''The transformers trainer process (full or LoRA).'''  # first line: the section's description

        resumable: ClassVar[frozenset[str]] = frozenset()  # its fields a resume may change
        model: str = Field("Qwen/Qwen3-0.6B", description="model to train")
        lora_rank: int | None = Field(None, ge=1, description="LoRA rank (None: full fine-tuning)")

        def check(self, run) -> None:
            if "fake" in run.envs:
                raise ValueError("the hf trainer trains on model episodes, not the fake env's")

        def build(self, ctx: BuildContext) -> Trainer:
            from orchestrator.hf.trainer import HFTrainer  # torch, transformers: only now

            return HFTrainer(ctx.run_dir, self, ctx.config)

    # here, in TRAINERS' table:
    "hf": "orchestrator.hf.config:HFTrainerConfig",

`orch run --set trainer.kind=hf --set trainer.hf.lora_rank=16` then selects it; `trainer.kind=nope`
is `orch: error: invalid config: trainer.kind: unknown trainer 'nope'; known: fake, hf`.
The runner looks every component up here by the config's names and owns nothing kind-specific.

What each kind builds:

* a trainer (`TrainerComponent.build` -> `Trainer`): `trainers/process.py` supervises a child
  process that reads batch files (`orchestrator.rundir.read_batch_file`, the layout every trainer
  shares) and publishes `rundir.weights_dir(run_dir, N)` then `rundir.mark_stable`; set
  `writes_weights = False` if it publishes versions without weights (the fake trainer);
* an inference backend (`InferenceComponent.build(ctx, envs)` -> `InferenceBackend`): samples one
  episode per `RolloutRequest` for the task of `envs[request.env]`; `follows_weights` says whether the run
  waits for and loads each published version;
* an env (`EnvComponent.open(ctx)`): an async context manager around the `RolloutEnv` (in this
  process or a client of `orch env-server`), or around an `AgentEnv` that plays whole episodes
  itself, its model calls through the `openai` backend's client (verifiers tasksets); checked
  before the run, closed after it. `synthetic = True` (the fake env): its episodes are not the
  model's tokens, so the model samplers and trainers refuse it;
* an algorithm (`AlgorithmComponent.build` -> `Algorithm`); its name must also be one the core
  knows (`orchestrator.core.advantages`), which folds its advantages.

The runner enters them on one `AsyncExitStack` (envs, sampler, trainer) and leaves them in the
reverse order; a component that fails raises a `ComponentFailed` (one line) and the run ends.
"""

from __future__ import annotations

import importlib
from abc import abstractmethod
from array import array
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, NamedTuple, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict

from orchestrator.core.arrays import LOGPROB_CODE, TOKEN_ID_CODE
from orchestrator.core.events import EpisodeCompleted

if TYPE_CHECKING:
    from contextlib import AbstractAsyncContextManager

    from orchestrator.config import RunConfig
    from orchestrator.envs.base import AgentEnv, RolloutEnv
    from orchestrator.hf.model import PreparedModel


class ConfigError(ValueError):
    """A user mistake in the configuration; its message is one line. (Here, not in
    `orchestrator.config`, so that a component's own checks of files and servers can raise it.)"""


class ComponentFailed(RuntimeError):
    """A component failed (a trainer died, an endpoint or env server gave up); its message says
    what, in one line, and the run ends with it (a resume continues once it is fixed)."""


class Section(BaseModel):
    """A config section: unknown keys and non-finite numbers are errors."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class Component(Section):
    """A component's config section; its class states what it supports and how it is built."""

    # Its fields a resume may change (they alter how the run is operated, not what it computes).
    resumable: ClassVar[frozenset[str]] = frozenset()

    def check(self, run: RunConfig) -> None:
        """Raise ValueError (one line) if this component cannot serve `run` as configured."""


class RolloutRequest(NamedTuple):
    """What one dispatched episode needs (immutable; a tuple: one is built per episode, and a
    frozen dataclass's field-by-field __init__ cost measurably in the instant pipeline)."""

    episode_id: int
    group_id: int
    env: str
    task_id: int
    attempt: int
    policy_version: int
    # An eval episode (docs/evals.md): sampled by `policy_version` exactly where the backend can
    # hold it, at the eval's own temperature. None for train episodes.
    eval_id: int | None = None
    temperature: float | None = None


def sampled_episode(
    req: RolloutRequest,
    *,
    prompt_ids: Sequence[int],
    completion_ids: Sequence[int],
    completion_logprobs: Sequence[float],
    reward: float,
    policy_start: int,
    policy_end: int,
    temperature: float,
) -> EpisodeCompleted:
    """A one-turn episode as a sampling backend returns it: the prompt (mask 0, logprob 0), then
    the sampled completion (mask 1), packed here once (orchestrator.core.arrays) rather than
    built as per-token lists and packed again by the event."""
    token_ids = array(TOKEN_ID_CODE, prompt_ids)
    token_ids.extend(completion_ids)
    logprobs = array(LOGPROB_CODE, bytes(4 * len(prompt_ids)))  # float32 zeros
    logprobs.extend(completion_logprobs)
    return EpisodeCompleted(
        episode_id=req.episode_id,
        group_id=req.group_id,
        ok=True,
        reward=reward,
        token_ids=token_ids,
        mask=bytes(len(prompt_ids)) + b"\x01" * len(completion_ids),
        logprobs=logprobs,
        policy_start=policy_start,
        policy_end=policy_end,
        temperature=temperature,
    )


Publish = Callable[[int, "dict[str, int | float] | None"], None]  # (version, the trainer's metrics for it)


@dataclass(frozen=True)
class BuildContext:
    """What a factory gets: the run's config and directory, and the policy version the run holds
    now (read when an episode starts and ends, so it is honest about updates landing meanwhile)."""

    config: RunConfig
    run_dir: Path
    version_now: Callable[[], int]
    model: PreparedModel | None = None  # the run's model dir, checked and hashed (the hf trainer's)


# ------------------------------------------------------------------------------------ interfaces
@runtime_checkable
class Trainer(Protocol):
    """Turns shipped batch files into published versions: `publish(N, metrics)` once step N's
    weights are out (rule 8: the version advances at confirmation), with the trainer's figures of
    that step (`orchestrator.rundir.TRAINER_METRICS`; None if it has none)."""

    async def start(self) -> None:
        """Start what runs outside this process (after a resume re-announced its batches)."""

    def batch_written(self, step: int, sha256: str, /) -> None:
        """Batch `step` is on disk with this sha256 (announced in step order)."""

    async def run(self, version: int, publish: Publish, /) -> None:
        """Train from `version` on, forever, calling `publish`; the loop owns and cancels it."""

    def check(self) -> None:
        """Raise if the trainer has failed (called at every loop iteration and while waiting)."""

    async def stop(self, timeout_s: float, /) -> None:
        """Let it exit cleanly within `timeout_s`, then end it: nothing is left running."""


@runtime_checkable
class InferenceBackend(Protocol):
    """Samples episodes: `await backend(request)` -> `EpisodeCompleted` (raising = a failed episode)."""

    follows_weights: ClassVar[bool]  # samples the trainer's published weights: `load` each version

    async def __call__(self, request: RolloutRequest, /) -> EpisodeCompleted: ...

    async def load(self, version: int, /, health_check: Callable[[], None] | None = None) -> None:
        """Make `version` current (bounded wait for its weights; `health_check` raises if the
        trainer that should publish them died). Called only if `follows_weights`."""

    async def aclose(self) -> None:
        """Release what it holds (threads, connections); reports what the run should know."""


@runtime_checkable
class Algorithm(Protocol):
    """Advantages of a closed group. Background-finalized algorithms run `finalize_group`
    concurrently for many groups, results coming back in any order."""

    name: ClassVar[str]
    finalize_in_background: ClassVar[bool]

    async def finalize_group(self, group_id: int, traces: Sequence[EpisodeCompleted], /) -> list[float]: ...


# ------------------------------------------------------------------------ the kinds' component bases
class TrainerComponent(Component):
    writes_weights: ClassVar[bool] = True  # publishes weights/step_N (+ STABLE) that samplers load

    def prepare_model(self, run: RunConfig, stored_hash: str | None) -> PreparedModel | None:
        """The model dir this trainer trains, checked and hashed before anything runs (ConfigError:
        one line); on a resume, also the one the run started from (`stored_hash`). None: no model."""
        return None

    def check_resume(self, run_dir: Path, trained_steps: int) -> None:
        """On a resume, before anything runs: ConfigError (one line) if what this trainer kept of
        the `trained_steps` steps the log says it trained (e.g. its checkpoint) is gone or damaged."""

    @abstractmethod
    def build(self, ctx: BuildContext) -> Trainer: ...


class InferenceComponent(Component):
    def check_model(self, run: RunConfig, model_dir: Path) -> None:
        """Before anything runs, ConfigError (one line) if this backend cannot sample `model_dir`
        (e.g. its servers cannot be launched, or a given endpoint serves another model)."""

    @abstractmethod
    def build(self, ctx: BuildContext, envs: Mapping[str, RolloutEnv | AgentEnv]) -> InferenceBackend:
        """`envs`: the run's envs that have a task source (`EnvComponent.open` gave one)."""


class EnvComponent(Component):
    # Its episodes are made up, not the model's tokens: no model sampler samples them, no model trainer learns them.
    synthetic: ClassVar[bool] = False
    # Its prompts are chat messages: the model's tokenizer must have a chat template to render them.
    gives_messages: ClassVar[bool] = False

    @abstractmethod
    def open(self, ctx: BuildContext) -> AbstractAsyncContextManager[RolloutEnv | AgentEnv | None]:
        """The env as rollout workers call it, for the run's duration (checked before the run;
        closed at its end). None: it has no task source (its episodes come whole from a backend)."""


class AlgorithmComponent(Component):
    @abstractmethod
    def build(self, ctx: BuildContext) -> Algorithm: ...


# -------------------------------------------------------------------------------------- registries
class Registry:
    """`name -> "module:Config"` for one kind; a config module is imported when first asked for."""

    def __init__(self, kind: str, table: Mapping[str, str]):
        self.kind, self._table = kind, dict(table)
        self._loaded: dict[str, type[Component]] = {}

    def names(self) -> list[str]:
        return sorted(self._table)

    def module(self, name: str) -> str:
        """The module that holds `name`'s config model (imported by `config`)."""
        self.known(name)
        return self._table[name].partition(":")[0]

    def known(self, name: str) -> str:
        """`name`, if it is one of this registry's (else ValueError listing the known ones)."""
        if name not in self._table:
            raise ValueError(f"unknown {self.kind} {name!r}; known: {', '.join(self.names())}")
        return name

    def config(self, name: str) -> type[Component]:
        """The config model of `name` (ValueError listing the known names if there is none)."""
        self.known(name)
        if name not in self._loaded:
            module, _, attr = self._table[name].partition(":")
            self._loaded[name] = getattr(importlib.import_module(module), attr)
        return self._loaded[name]

    def configs(self) -> dict[str, type[Component]]:
        return {name: self.config(name) for name in self.names()}


TRAINERS = Registry(
    "trainer",
    {
        "fake": "orchestrator.trainers.fake:FakeTrainerConfig",
        "hf": "orchestrator.hf.config:HFTrainerConfig",
    },
)
INFERENCE = Registry(
    "inference backend",
    {
        "embedded": "orchestrator.embedded.sampler_backend:EmbeddedSamplerConfig",
        "openai": "orchestrator.inference.endpoints_config:EndpointsConfig",
        "fake": "orchestrator.envs.fake:FakeEpisodesConfig",
    },
)
ENVS = Registry(
    "env",
    {
        "reverse_text": "orchestrator.envs.reverse_text:ReverseTextConfig",
        "fake": "orchestrator.envs.fake:FakeEnvConfig",
        "verifiers": "orchestrator.verifiers.config:VerifiersConfig",
    },
)
ALGORITHMS = Registry(
    "algorithm",
    {
        "grpo": "orchestrator.finalizers:GRPOConfig",
        "gar": "orchestrator.finalizers:GARConfig",
    },
)


def synthetic_envs(run: RunConfig) -> list[str]:
    """The run's envs whose episodes are not the model's tokens (`EnvComponent.synthetic`)."""
    return [name for name in run.envs if getattr(ENVS.config(name), "synthetic", False)]
