"""What components are to the run: their interfaces, the records they exchange, their errors.

The bottom of the wiring: it imports the core alone (and pydantic), and every component, the
composition root (`orchestrator.config`: the registries, `RunConfig`, the rules that span
components) and the shell build on it. A kind of component (trainer, inference backend, env,
algorithm) is a config section, a subclass of its kind's base below, and a factory:

* the section (`trainer.<kind>`, `inference.<kind>`, `env.<name>`, `algorithm.<name>`) holds the
  component's own settings; `check(plan)` says what it supports (run while the config is
  validated: a bad combination is a one-line error before anything runs), told only what the
  run is made of (`RunPlan`), never the whole `RunConfig`;
* the factory (`build`/`open`) gets its section (`self`) and a `BuildContext` (the run's
  directory, seed, sampling settings, prepared model), and imports the heavy parts (torch,
  httpx) only then. A section module stays light: pydantic and the stdlib.

A component of orch is a module and one line of its kind's table in `orchestrator.config`; a
component of your own package needs neither (docs/plugins.md: an entry point, or a
`module:Attribute` as its name). E.g. a built-in trainer (the real `hf` one is orchestrator/hf/component.py):

    # orchestrator/probe/component.py
    class ProbeTrainerConfig(TrainerComponent):
        '''A trainer that probes.'''  # first line: the section's description

        resumable: ClassVar[frozenset[str]] = frozenset({"depth"})  # fields a resume may change
        depth: int = Field(2, ge=1, description="how deep it probes")

        def build(self, ctx: BuildContext) -> Trainer:
            from orchestrator.probe.trainer import ProbeTrainer  # the heavy parts: only now

            return ProbeTrainer(ctx.run_dir, self.depth)

    # orchestrator/config.py, in TRAINERS' table:
    "probe": "orchestrator.probe.component:ProbeTrainerConfig",

`orch run --set trainer.kind=probe --set trainer.probe.depth=3` then selects it; `trainer.kind=nope`
is `orch: error: invalid config: trainer.kind: unknown trainer 'nope'; known: fake, hf, probe`.

What each kind builds:

* a trainer (`TrainerComponent.build` -> `Trainer`): `trainers/process.py` supervises a child
  process that reads batch files (`orchestrator.rundir.read_batch_file`, the layout every trainer
  shares) and publishes `rundir.weights_dir(run_dir, N)` then `rundir.mark_stable`; set
  `writes_weights = False` if it publishes versions without weights (the fake trainer);
* an inference backend (`InferenceComponent.build(ctx, envs)` -> `InferenceBackend`): samples one
  episode per `RolloutRequest` for the task of `envs[request.env]`; `follows_weights` says whether
  the run waits for and loads each published version;
* an env (`EnvComponent.open(ctx)`): an async context manager around the `RolloutEnv` (in this
  process or a client of `orch env-server`), or around an `AgentEnv` that plays whole episodes
  itself, its model calls through the backend's `ModelCalls`; checked before the run, closed after
  it. `synthetic = True` (the fake env): its episodes are not the model's tokens, so the model
  samplers and trainers refuse it;
* an algorithm (`AlgorithmComponent.build` -> `Algorithm`): one module of orchestrator/algorithms,
  whose section also says whether it finalizes in the background and what it puts in the core's
  params; one the core scores inline also names its scorer in `orchestrator.core.advantages`.

The shell enters them on one `AsyncExitStack` (envs, sampler, trainer) and leaves them in the
reverse order; a component that fails raises a `ComponentFailed` (one line) and the run ends.
"""

from __future__ import annotations

from abc import abstractmethod
from array import array
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, NamedTuple, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict

from orchestrator.core.arrays import LOGPROB_CODE, TOKEN_ID_CODE, Tokens
from orchestrator.core.events import EpisodeCompleted, checked, version_runs
from orchestrator.placement import LOCAL, Placement


# ----------------------------------------------------------------------------------------- errors
class ConfigError(ValueError):
    """A user mistake in the configuration; its message is one line. (Here, not in
    `orchestrator.config`, so that a component's own checks of files and servers can raise it.)"""


class ComponentFailed(RuntimeError):
    """A component failed (a trainer died, an endpoint or env server gave up); its message says
    what, in one line, and the run ends with it (a resume continues once it is fixed)."""

    # What a failed episode is blamed on when this is what it raised (`episode_error`).
    failure_source: ClassVar[str] = "env"


def episode_error(exc: BaseException) -> str:
    """A failed episode's recorded error: what failed first ("inference" for the inference
    client's errors, "env" for anything else an episode raises: its own code, grader or env
    server), then the exception (docs/resume.md, "Faults")."""
    return f"{getattr(exc, 'failure_source', 'env')}: {type(exc).__name__}: {exc}"


# ---------------------------------------------------------------------------------------- records
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
    token_versions: tuple[tuple[int, int], ...] = (),
) -> EpisodeCompleted:
    """A one-turn episode as a sampling backend returns it: the prompt (mask 0, logprob 0), then
    the sampled completion (mask 1), packed here once (orchestrator.core.arrays) rather than
    built as per-token lists and packed again by the event."""
    token_ids = array(TOKEN_ID_CODE, prompt_ids)
    token_ids.extend(completion_ids)
    logprobs: array[float] = array(LOGPROB_CODE, bytes(4 * len(prompt_ids)))  # float32 zeros
    logprobs.extend(completion_logprobs)
    mask = bytes(len(prompt_ids)) + b"\x01" * len(completion_ids)
    return episode_of_samples(
        req,
        [TrainingSample(token_ids, mask, logprobs)],
        reward=reward,
        policy_start=policy_start,
        policy_end=policy_end,
        temperature=temperature,
        version_segments=token_versions,
    )


class TrainingSample(NamedTuple):
    """One training sample of an episode as an env made it (docs/rules.md, "Samples"): its token
    ids, sampled-token mask (0/1) and logprobs (0.0 off the sampled tokens), and the agent whose
    sample it is (None: the episode's only agent)."""

    token_ids: Sequence[int]
    mask: Sequence[int]
    logprobs: Sequence[float]
    agent: str | None = None


def episode_of_samples(
    req: RolloutRequest,
    samples: Sequence[TrainingSample],
    *,
    reward: float,
    policy_start: int,
    policy_end: int,
    temperature: float,
    version_segments: Sequence[tuple[int, int]] = (),
    agent_rewards: Mapping[str, float] | None = None,
) -> EpisodeCompleted:
    """An ok episode of one or more samples, as the log holds it: their arrays one after the
    other, `samples` giving each one's [tokens, sampled tokens] when there are several, `agents`
    each one's agent and `agent_rewards` the reward of each (when the samples name agents).
    `version_segments` are (version, sampled tokens) over all the samples' sampled tokens in
    order, where the env knows them (empty: bounds only). ValueError (one line) for samples
    that do not make an episode (none at all, misaligned arrays, an agent without a reward)."""
    if not samples:
        raise ValueError("the episode yielded no sample")
    if len(samples) == 1:  # as it is: the event packs what is not packed yet
        token_ids, mask, logprobs = samples[0].token_ids, samples[0].mask, samples[0].logprobs
    else:
        token_ids, mask, logprobs = array(TOKEN_ID_CODE), bytearray(), array(LOGPROB_CODE)
        for sample in samples:
            token_ids.extend(sample.token_ids)
            mask.extend(sample.mask)  # bytes, or bools (ints)
            logprobs.extend(sample.logprobs)
        mask = bytes(mask)
    named = [sample.agent for sample in samples if sample.agent is not None]
    if named and len(named) != len(samples):
        raise ValueError("either every sample of an episode names its agent or none does")
    agents = tuple(named)
    return checked(
        EpisodeCompleted,
        episode_id=req.episode_id,
        group_id=req.group_id,
        ok=True,
        reward=reward,
        tokens=Tokens.of(token_ids, mask, logprobs),
        policy_start=policy_start,
        policy_end=policy_end,
        temperature=temperature,
        token_versions=version_runs(version_segments),
        samples=tuple((len(s.token_ids), sum(s.mask)) for s in samples) if len(samples) > 1 else (),
        agents=agents,
        agent_rewards=tuple(sorted((agent_rewards or {}).items())) if agents else (),
    )


class PreparedModel(NamedTuple):
    """The run's model dir, checked before anything runs, and its files' sha256 (kept in the
    log's meta, so a resume can tell whether it changed)."""

    path: Path
    sha256: str


@dataclass(frozen=True)
class ModelRequest:
    """What a trainer's `prepare_model` is asked for: the `model` section's dir (None: the tiny
    reverse_text model, built under `cache_dir`), whether an env gives chat messages (then
    the tokenizer needs a chat template), and whether the sampler's servers take each version
    pushed from the trainer process (then every tensor must fit the trainer's push buckets)."""

    path: Path | None
    cache_dir: Path
    env_gives_messages: bool
    weights_pushed: bool = False


@dataclass(frozen=True)
class RunPlan:
    """What a component's `check` is told of the run besides its own section: what it is made of."""

    envs: tuple[str, ...]  # the train envs
    eval_envs: tuple[str, ...]  # the envs evaluated on a schedule (docs/evals.md)
    inference: str  # the inference backend's name
    requests_in_flight: int = 0  # episodes in flight at most: rollout.max_inflight + eval.max_inflight
    finalize_in_background: bool = False  # the algorithm's groups finalize in the background
    placement: str = "local"  # where the processes components start run (the run's `placement`)


@dataclass(frozen=True)
class Sampling:
    """The run's sampling settings, which every backend reads (the `rollout` and `model` sections)."""

    temperature: float
    max_new_tokens: int
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)


Publish = Callable[[int, "dict[str, int | float] | None"], None]  # (version, the trainer's metrics for it)


class StartedEarly(Protocol):
    """What a trainer started before its run (`TrainerComponent.start_early`); the run closes it at
    its end, which ends it if its trainer never started it."""

    def close(self) -> None: ...


@dataclass(frozen=True)
class BuildContext:
    """What a factory gets besides its own section: the run's directory and settings every
    component may read, and the policy version the run holds now (read when an episode starts
    and ends, so it is honest about updates landing meanwhile)."""

    run_dir: Path
    seed: int
    max_steps: int
    sampling: Sampling
    version_now: Callable[[], int]
    publish_timeout_s: float  # the longest wait for the trainer's next version
    kept_versions: int  # weight versions that must stay on disk: a resume reloads the oldest
    max_restarts: int = 0  # times a dead trainer process is restarted from its checkpoint
    model: PreparedModel | None = None  # the run's model dir, checked and hashed (the hf trainer's)
    started_early: StartedEarly | None = None  # what the trainer started before the run (start_early)
    served_model: str | None = None  # the model name the inference backend's servers serve it under
    # The inference backend's servers take each version pushed from the trainer process, not from
    # its weights dir (`InferenceComponent.pulls_pushed_weights`): the trainer pushes them, over
    # `push_transport` where orch launches the servers (`InferenceComponent.pushed_transport`).
    weights_pushed: bool = False
    push_transport: str | None = None
    placement: Placement = LOCAL  # where the processes a component starts run (servers, trainer)
    env_sections: Mapping[str, EnvComponent] = field(default_factory=dict)  # the run's envs' sections


# ------------------------------------------------------------------------------------------- envs
@dataclass(frozen=True)
class Task:
    env: str
    index: int
    prompt: str
    answer: str
    # The prompt as chat messages ({"role", "content"}), rendered with the model's chat template;
    # None: the prompt is plain text, sent as its tokens.
    messages: list[dict[str, str]] | None = None


class TextEnv(Protocol):
    """A deterministic task source and a scorer: tasks are a pure function of ``(seed, index)``,
    so a resumed or re-executed run sees exactly the same tasks. It never samples the policy: the
    rollout worker asks the policy for a completion of ``task.prompt`` and hands the text back to
    :meth:`score`."""

    name: str

    def task(self, index: int) -> Task:
        """The task at cursor position ``index`` (deterministic)."""
        ...

    def score(self, task: Task, completion: str) -> float:
        """Reward in [0, 1] for ``completion`` as an answer to ``task``."""
        ...


class RolloutEnv(Protocol):
    """A `TextEnv` as the rollout workers call it: awaited, so it may live in another process
    (``orchestrator.envs.client.HttpEnvClient``, a client of ``orch env-server``)."""

    async def task(self, index: int) -> Task: ...

    async def score(self, task: Task, completion: str) -> float: ...


class InProcessEnv:
    """A `TextEnv` of this process behind the `RolloutEnv` interface."""

    def __init__(self, env: TextEnv) -> None:
        self.env = env

    async def task(self, index: int) -> Task:
        return self.env.task(index)

    async def score(self, task: Task, completion: str) -> float:
        return self.env.score(task, completion)


class ModelCalls(Protocol):
    """What an `AgentEnv` calls on the run's inference (the `openai` backend's client): the
    generate route, routed, retried and version-stamped like the backend's own requests."""

    async def generate(self, path: str, body: dict[str, Any], *, pin: Any = None, at_version: int | None = None) -> Any:
        """POST `body` to `path` on an endpoint (a group keeps one: `pin`; an eval episode's call
        asks for its pinned version: `at_version`); the answer with its endpoint, versions and
        attempts."""

    async def models(self) -> Any:
        """An endpoint's `GET /v1/models` answer."""


@runtime_checkable
class AgentEnv(Protocol):
    """An env that plays each episode itself (an agent run: several model calls, multi-turn), its
    model calls through the sampler's `ModelCalls` (the `openai` backend hands its client over);
    it returns the episode with its samples (`episode_of_samples`: one, or several where the
    context was rewritten or several agents trained), raising for a failed episode."""

    async def episode(self, request: RolloutRequest, model: ModelCalls, /) -> EpisodeCompleted: ...


# ------------------------------------------------------------------------------------- interfaces
@runtime_checkable
class Trainer(Protocol):
    """Turns shipped batch files into published versions: `publish(N, metrics)` once step N's
    weights are out (docs/rules.md: the version advances at confirmation), with the trainer's
    figures of that step (`orchestrator.rundir.TRAINER_METRICS`; None if it has none). Step N is
    in its checkpoint before version N is published: the batch files of published versions are
    removed (`log.batch_files`), so a restarted trainer never needs them again."""

    async def start(self) -> None:
        """Start what runs outside this process (after a resume re-announced its batches)."""

    def batch_written(self, step: int, sha256: str, /) -> None:
        """Batch `step` is on disk with this sha256 (announced in step order)."""

    async def run(self, version: int, publish: Publish, /) -> None:
        """Train from `version` on, forever, calling `publish`; the loop owns and cancels it."""

    def check(self) -> None:
        """Raise if the trainer has failed (called at every loop iteration and while waiting)."""

    def report_restarts_to(self, listener: Callable[[int, str], None], /) -> None:
        """Call `listener(attempt, cause)` each time `check` restarts a dead trainer process from
        its checkpoint (a logged input); a trainer that never restarts never calls it."""

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

    async def watch(self, report_endpoint_change: Callable[[str, bool, int, str], None], /) -> None:
        """For the whole run (the loop owns and cancels it): the servers it launched, restarted
        when they die or freeze, each down and up reported as `(url, up, attempt, cause)` (a
        logged input). A backend that launched nothing returns at once."""

    async def aclose(self) -> None:
        """Release what it holds (threads, connections); reports what the run should know."""


@runtime_checkable
class Algorithm(Protocol):
    """Advantages of a closed group. Background-finalized algorithms run `finalize_group`
    concurrently for many groups, results coming back in any order."""

    async def finalize_group(self, group_id: int, episodes: Sequence[EpisodeCompleted], /) -> list[float]: ...


# ------------------------------------------------------------------------------- config sections
class Section(BaseModel):
    """A config section: unknown keys and non-finite numbers are errors."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class Component(Section):
    """A component's config section; its class states what it supports and how it is built."""

    # Its fields a resume may change (they alter how the run is operated, not what it computes).
    resumable: ClassVar[frozenset[str]] = frozenset()

    def check(self, plan: RunPlan) -> None:
        """Raise ValueError (one line) if this component cannot serve a run made of `plan`."""


class TrainerComponent(Component):
    writes_weights: ClassVar[bool] = True  # publishes weights/step_N (+ STABLE) that samplers load
    # The format of those weights ("hf": an HF model dir or PEFT adapter), which a given server's
    # pre-flight check matches against what it loads; None: none, or not known.
    weight_format: ClassVar[str | None] = None
    # It learns the model's own tokens: a synthetic env's episodes are refused (the message).
    refuses_synthetic: ClassVar[str | None] = None

    def prepare_model(self, request: ModelRequest, stored_hash: str | None) -> PreparedModel | None:
        """The model dir this trainer trains, checked and hashed before anything runs (ConfigError:
        one line); on a resume, also the one the run started from (`stored_hash`). None: no model."""
        return None

    def check_resume(self, run_dir: Path, trained_steps: int) -> None:
        """On a resume, before anything runs: ConfigError (one line) if what this trainer kept of
        the `trained_steps` steps the log says it trained (e.g. its checkpoint) is gone or damaged."""

    def push_refusal(self, servers_transport: str | None) -> str | None:
        """Why this trainer cannot push each version into the inference servers itself (the
        `vllm_push` weight sync), in a clause the run's message ends with; None: it can.
        `servers_transport`: what the servers receive over, where orch launches them (None:
        unknown)."""
        return "it has no weight push"

    def start_early(self, run_dir: Path) -> StartedEarly | None:
        """Start, before the model is checked and before `run_dir` exists, what is slow to start
        and needs nothing of the run yet (the hf trainer: its process, importing torch), so that it
        overlaps those checks; `build` gets it as `ctx.started_early`. None: nothing."""
        return None

    @abstractmethod
    def build(self, ctx: BuildContext) -> Trainer: ...


class InferenceComponent(Component):
    follows_weights: ClassVar[bool] = True
    # It samples the model: a synthetic env's episodes are refused (the message), and it needs a
    # trainer that writes weights (`sampler` names it in that message).
    refuses_synthetic: ClassVar[str | None] = None
    sampler: ClassVar[str] = "the sampler"

    def served_model(self) -> str | None:
        """The name its servers serve the model under (None: they serve it as its dir)."""
        return None

    def pulls_pushed_weights(self) -> bool:
        """Its servers take each version pushed from the trainer process, not read from disk."""
        return False

    def launched_gpus(self) -> list[str]:
        """Each server it launches: its GPUs (CUDA_VISIBLE_DEVICES); empty: none on GPUs."""
        return []

    def pushed_transport(self) -> str | None:
        """What its servers receive pushed versions over (nccl, gloo), where orch launches them
        and so knows it; None: unknown, or nothing pushed."""
        return None

    def preflight_servers(self, weight_format: str | None) -> None:
        """The first pre-run step, before the model is built (which can be slow): ConfigError (one
        line) if a server given to this backend cannot serve the run (unreachable, failing, or
        unable to load `weight_format`, what the trainer publishes)."""

    def preflight(self, model_dir: Path) -> None:
        """The pre-run step, before the run dir exists: ConfigError (one line) if this backend
        cannot sample `model_dir` (e.g. its servers cannot be launched, or a given endpoint
        serves another model)."""

    @abstractmethod
    def build(self, ctx: BuildContext, envs: Mapping[str, RolloutEnv | AgentEnv]) -> InferenceBackend:
        """`envs`: the run's envs that have a task source (`EnvComponent.open` gave one)."""


class EnvComponent(Component):
    # Its episodes are made up, not the model's tokens: no model sampler samples them, no model trainer learns them.
    synthetic: ClassVar[bool] = False
    # Its prompts are chat messages: the model's tokenizer must have a chat template to render them.
    gives_messages: ClassVar[bool] = False

    def solved(self, reward: float) -> bool | None:
        """Its success notion (the "pass" of an eval's pass@k, docs/evals.md) for an episode's
        reward; None: it has none (its evals report no pass@k)."""
        return None

    def preflight(self, seed: int) -> None:
        """The pre-run step, before the run dir exists: ConfigError (one line) if what it needs
        (a package, a module, its files, its server serving the run's `seed`) cannot work here.
        (Its settings alone: `check`.)"""

    def text_env(self, seed: int) -> TextEnv | None:
        """Its tasks as a `TextEnv` an `orch env-server` can host (None: it cannot be served)."""
        return None

    @abstractmethod
    def open(self, ctx: BuildContext) -> AbstractAsyncContextManager[RolloutEnv | AgentEnv | None]:
        """The env as rollout workers call it, for the run's duration (checked before the run;
        closed at its end). None: it has no task source (its episodes come whole from a backend)."""


class TextEnvComponent(EnvComponent):
    """An env whose tasks and scorer are a `TextEnv` in this process (docs/plugins.md): a
    subclass defines `text_env(seed)`; task `index >= 0` is a train task, `index < 0` a held-out
    one (docs/evals.md), and `solved` its success notion, if it has one."""

    @abstractmethod
    def text_env(self, seed: int) -> TextEnv: ...

    def preflight(self, seed: int) -> None:
        """Its first train task under the run's `seed`, built before the run dir exists: a `Task`
        with a text prompt, or a ConfigError naming what it gave."""
        name = type(self).__qualname__
        try:
            env = self.text_env(seed)
        except Exception as err:  # noqa: BLE001 - any error of the env's code is reported alike
            raise ConfigError(f"{name}: text_env({seed}) raised {type(err).__name__}: {err}") from None
        try:
            task = env.task(0)
        except Exception as err:  # noqa: BLE001
            raise ConfigError(f"{name}: text_env({seed}).task(0) raised {type(err).__name__}: {err}") from None
        if not isinstance(task, Task) or not isinstance(task.prompt, str):
            raise ConfigError(
                f"{name}: text_env({seed}).task(0) gave {type(task).__name__}, not an "
                "orchestrator.contracts.Task with a text prompt"
            )

    @asynccontextmanager
    async def open(self, ctx: BuildContext) -> AsyncIterator[RolloutEnv]:
        yield InProcessEnv(self.text_env(ctx.seed))


class AlgorithmComponent(Component):
    """An algorithm's section: its settings and how it scores a group (orchestrator/algorithms)."""

    # Whether its groups finalize in the background by default (`algorithm.finalize_in_background`
    # overrides it). Inline needs a scorer the core runs (`orchestrator.core.advantages`), which a
    # plugin's algorithm has not: it finalizes in the background.
    finalize_in_background: ClassVar[bool] = True

    def core_settings(self) -> dict[str, Any]:
        """Its settings that the core's inline scorer reads: `CoreParams` fields (logged in
        `run_started`, so a log is re-scored on its own)."""
        return {}

    @abstractmethod
    def build(self, ctx: BuildContext) -> Algorithm: ...
