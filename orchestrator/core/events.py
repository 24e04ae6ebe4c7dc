"""The event catalogue (docs/log-format.md): one msgspec Struct per kind, which is at once the
event the core builds and folds, and its codec.

An event is either an *input* (a fact from the outside world: a finished episode, a background
finalize result, a published version, a stop request, a start/resume marker) or a *decision*
that `decide` derived from one, and its kind says which: each event class's `role` (the kinds
whose role is "input" are `INPUT_KINDS`). Both are logged; `evolve` folds both. A group scored
inline is the decision `group_finalized`; the same result from a background finalize is the input
`background_finalized`.

In the log, `kind` is the column and `data` is the event's JSON: its fields, a field at its
default left out. An `episode_completed`'s token arrays are the row's payload (`arrays.Tokens`).
Constructing an event checks nothing but its own invariants (`__post_init__`): the core builds
its decisions from values valid by construction; what comes from outside is checked with
`checked`, and every decoded row is type-checked by its decoder.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterable
from typing import Any, ClassVar, Literal, TypeVar

import msgspec
from pydantic import BaseModel, ConfigDict, Field, model_validator

from orchestrator.core.advantages import INLINE_SCORERS
from orchestrator.core.arrays import LOGPROB_CODE, TOKEN_ID_CODE, Tokens

# The event format's version: raised with every change to what an event's row holds, so that a log
# is read only by the code that knows its format; what each version changed is in
# docs/log-format.md, "Version history", and a log of another version is refused.
EVENT_SCHEMA_VERSION = 6


def check_schema_version(version: int | str) -> None:
    """ValueError (one line, naming the version) for a log this code does not read."""
    if str(version) != str(EVENT_SCHEMA_VERSION):
        raise ValueError(
            f"an orch log of format version {version}; this orch reads version {EVENT_SCHEMA_VERSION} "
            'only (docs/log-format.md, "Version history")'
        )


class _Params(BaseModel):
    # The run's settings, validated with the config they come from. NaN/Inf are refused.
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class EvalParams(_Params):
    """Evaluations on a schedule (docs/evals.md): held-out tasks sampled beside training, outside
    the train gate, never trained on. Off unless `CoreParams.eval` is set."""

    envs: list[str] = Field(min_length=1, description="envs to evaluate (each must be a train env)")
    every: int = Field(10, ge=1, description="an eval every N published versions, plus version 0 and the last")
    num_tasks: int = Field(16, ge=1, description="held-out tasks per eval (the same ones every time)")
    samples_per_task: int = Field(4, ge=1, description="samples per task: the k of pass@k")
    temperature: float = Field(1.0, gt=0, description="sampling temperature of eval episodes")
    max_inflight: int = Field(16, ge=1, description="eval episodes in flight at once (apart from max_inflight)")

    @model_validator(mode="after")
    def _distinct_envs(self) -> EvalParams:
        if len(set(self.envs)) != len(self.envs):
            raise ValueError(f"eval envs must be distinct, got {self.envs}")
        return self


class CoreParams(_Params):
    """Every knob of the rules in docs/rules.md. Carried by `run_started`, so a log folds on its own."""

    seed: int = Field(0, description="seeds env choice and everything random in the core")
    env_ratios: dict[str, float] = Field(
        default_factory=lambda: {"reverse_text": 1.0},
        description="train envs and their dispatch ratios (chosen with the seeded RNG)",
    )
    group_size: int = Field(8, ge=1, description="episodes per group (one task)")
    batch_size: int = Field(64, ge=1, description="samples per batch")
    token_batch_size: int | None = Field(None, ge=1, description="if set, cut batches by tokens instead of samples")
    constant_trainer_batch_size: bool = Field(
        False, description="prune zero-advantage samples before the cut, so every batch is full"
    )
    max_inflight: int = Field(64, ge=1, description="in-flight episode permits")
    target_lag: int = Field(1, ge=0, description="batch N ships once version >= N-1-target_lag")
    max_off_policy_steps: int = Field(
        2, ge=0, description="samples whose oldest token is older than (step-1)-max_off_policy_steps are dropped"
    )
    max_finalizing_groups: int = Field(
        64, ge=1, description="background-finalizing groups (per env) that close the dispatch gate"
    )
    max_steps: int = Field(20, ge=1, description="batches to ship before draining")
    algorithm: str = Field("grpo", description="the algorithm's name (`algorithm.name`)")
    finalize_in_background: bool = Field(
        False, description="resolved from the algorithm's class flag and the config override"
    )
    # grpo's setting, as its section puts it here (`AlgorithmComponent.core_settings`).
    std_normalization: bool = Field(False, description="grpo: advantages divided by the group's std")
    zero_output_batches: int = Field(
        10, ge=1, description="batch-equivalents of zero output in a row that stop the run"
    )
    # Rule 1 (d). New runs get "staleness" from the config's default.
    capacity: Literal["off", "staleness"] = Field(
        "off",
        description="staleness: start a group only while the work dispatched and not yet shipped "
        "or dropped can still train in the steps that would accept it; off: max_inflight alone",
    )
    # Rule 6 and the batch file (docs/rules.md, "Samples").
    batch_cut: Literal["prefix", "groups"] = Field(
        "prefix",
        description="groups: a batch takes whole groups (a group's samples never split across batches); "
        "prefix: the oldest batch_size samples, a group split at the edge",
    )
    sample_weight: Literal["episode", "sample"] = Field(
        "episode",
        description="each sample's loss weight: episode: 1/N for the N samples of an episode, so an episode "
        "weighs the same however many samples it has; sample: 1 each",
    )
    eval: EvalParams | None = Field(None, description="evaluations on a schedule (None: none)")

    @model_validator(mode="after")
    def _check(self) -> CoreParams:
        if not self.env_ratios or any(r <= 0 for r in self.env_ratios.values()):
            raise ValueError("env_ratios must name at least one env, each with a ratio > 0")
        if self.algorithm not in INLINE_SCORERS and not self.finalize_in_background:
            # E.g. a grader's or a plugin's algorithm (docs/plugins.md): the core folds the
            # advantages its background finalize returns.
            raise ValueError(
                f"algorithm {self.algorithm!r} is not one the core scores inline "
                f"({', '.join(sorted(INLINE_SCORERS))}): it must finalize in the background"
            )
        if self.eval is not None and not set(self.eval.envs) <= set(self.env_ratios):
            raise ValueError(
                f"eval envs {self.eval.envs} must be train envs ({list(self.env_ratios)}): "
                "their rollouts run on the train envs' backends"
            )
        return self


class Event(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, forbid_unknown_fields=True, gc=False):
    """An event: one subclass per kind, declaring its fields once. Frozen: the same object lives
    in the log buffer and in the state. No GC tracking: an event holds no reference cycle.

    A field at its default is not written. Defaults are only None, False, 0 and empty
    collections, which msgspec recognises whatever object holds them; a float field has no
    default (an equal float computed elsewhere is another object, and would be written), so
    equal events always write the same bytes."""

    kind: ClassVar[str]  # the discriminator: the log's `kind` column
    # "input" (a fact from the outside world, handed to `decide`) or "decision" (what `decide`
    # derived from one).
    role: ClassVar[Literal["input", "decision"]]


class RunStarted(Event, frozen=True, kw_only=True, omit_defaults=False):
    """A run's first event: every field written, so the row names its format."""

    role = "input"
    kind = "run_started"
    schema_version: int = EVENT_SCHEMA_VERSION
    params: CoreParams


class RunResumed(Event, frozen=True, kw_only=True):
    role = "input"
    kind = "run_resumed"
    from_seq: int
    max_steps: int
    # `orch run --resume --drop-damaged`: held traces, never shipped, whose token payloads are lost
    # (a side file missing or damaged); the resume drops them first.
    damaged_traces: list[int] = []


class GroupDispatched(Event, frozen=True, kw_only=True):
    role = "decision"
    kind = "group_dispatched"
    group_id: int
    env: str
    task_id: int
    group_size: int
    policy_version: int


class EpisodeDispatched(Event, frozen=True, kw_only=True):
    role = "decision"
    kind = "episode_dispatched"
    episode_id: int
    group_id: int
    attempt: int
    policy_version: int


class EpisodeCompleted(Event, frozen=True, kw_only=True):
    """An episode's result: its one training sample, or several (`samples`)."""

    role = "input"
    kind = "episode_completed"
    episode_id: int
    group_id: int
    ok: bool
    reward: float
    # Its token ids, sampled mask and logprobs: their sizes in the row, the arrays its payload.
    # None: no token (a failed episode).
    tokens: Tokens | None = None
    policy_start: int
    policy_end: int
    temperature: float
    error: str | None = None
    # The version of each sampled token, in their order, as runs [version, tokens]: given when
    # they came from more than one version (`version_runs`). Empty: all from policy_start when
    # policy_end equals it, else from versions between the two that the backend could not tell
    # apart (docs/rules.md, "A token's version").
    token_versions: tuple[tuple[int, int], ...] = ()
    # Several training samples (docs/rules.md, "Samples"): the arrays are the samples' arrays one
    # after the other, each given as [tokens, sampled tokens], in order; `token_versions` runs
    # over all their sampled tokens. Empty: the arrays are the episode's one sample.
    samples: tuple[tuple[int, int], ...] = ()
    # The agent of each sample (an episode of several trainable agents), and the reward of each
    # agent where the env scores them apart, as [agent, reward] pairs (empty: every sample takes
    # `reward`).
    agents: tuple[str, ...] = ()
    agent_rewards: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        # Runs for every row a fold decodes: the common case (floats, no agents) costs two checks.
        if type(self.reward) is not float or type(self.temperature) is not float:
            _store_as_float(self, "reward", "temperature")
        if not (math.isfinite(self.reward) and math.isfinite(self.temperature)):
            raise ValueError(f"reward {self.reward} and temperature {self.temperature} must be finite")
        if self.tokens is not None and self.tokens.sampled_tokens > self.tokens.n_tokens:
            raise ValueError(f"tokens {[self.tokens.n_tokens, self.tokens.sampled_tokens]}: more sampled than in all")
        if self.agent_rewards and not all(type(r) is float and math.isfinite(r) for _, r in self.agent_rewards):
            raise ValueError(f"agent_rewards {list(self.agent_rewards)}: each reward a finite float")
        if self.token_versions:
            check_version_runs(self.token_versions, self.sampled_tokens, self.policy_start, self.policy_end)
        if self.samples or self.agents or self.agent_rewards:
            check_samples(self)

    @property
    def trace_id(self) -> int:
        """Its id as the state holds it (a trace: docs/rules.md, "Words")."""
        return self.episode_id

    @property
    def n_tokens(self) -> int:
        return self.tokens.n_tokens if self.tokens is not None else 0

    @property
    def sampled_tokens(self) -> int:
        return self.tokens.sampled_tokens if self.tokens is not None else 0

    # The arrays, unpacked from the payload when first read (`arrays.Tokens`).
    @property
    def token_ids(self) -> array:
        return self.tokens.token_ids if self.tokens is not None else array(TOKEN_ID_CODE)

    @property
    def mask(self) -> bytes:
        return self.tokens.mask if self.tokens is not None else b""

    @property
    def logprobs(self) -> array:
        return self.tokens.logprobs if self.tokens is not None else array(LOGPROB_CODE)


# Sample k of episode e is named `e + k * SAMPLE_ID_STRIDE`: sample 0 is the episode's own id, so
# a one-sample episode's sample is named as its episode always was (docs/log-format.md, "Samples").
SAMPLE_ID_STRIDE = 10**12


def sample_id(episode_id: int, index: int) -> int:
    """The id of sample `index` of episode `episode_id` (its id in the queue and batches)."""
    return episode_id + index * SAMPLE_ID_STRIDE


def episode_of(trace_id: int) -> int:
    """The episode a sample id names."""
    return trace_id % SAMPLE_ID_STRIDE


def check_samples(e: EpisodeCompleted) -> None:
    """ValueError (one line) unless `samples`, `agents` and `agent_rewards` describe `e`'s arrays."""
    if e.samples:
        if len(e.samples) < 2:
            raise ValueError("samples lists two or more samples (one sample: leave it empty)")
        if any(n <= 0 or not 0 <= k <= n for n, k in e.samples):
            raise ValueError(f"samples {list(e.samples)}: each is [tokens > 0, sampled tokens <= tokens]")
        if sum(n for n, _ in e.samples) != e.n_tokens:
            raise ValueError(f"samples count {sum(n for n, _ in e.samples)} tokens where the episode has {e.n_tokens}")
        if sum(k for _, k in e.samples) != e.sampled_tokens or not _each_sample_fits_its_mask(e):
            raise ValueError(f"samples {list(e.samples)} do not match the mask's sampled tokens")
    if e.agents and len(e.agents) != max(1, len(e.samples)):
        raise ValueError(f"agents names {len(e.agents)} samples where the episode has {max(1, len(e.samples))}")
    scored = [name for name, _ in e.agent_rewards]
    if e.agent_rewards and (len(set(scored)) != len(scored) or set(scored) != set(e.agents)):
        raise ValueError(f"agent_rewards scores {scored}, the samples' agents are {sorted(set(e.agents))}")


def _each_sample_fits_its_mask(e: EpisodeCompleted) -> bool:
    """Each sample's sampled tokens are its part of the mask's, where the arrays are in memory (a
    decoded row's are checked when its payload is read: `arrays.Tokens.part`)."""
    if e.tokens is None or not e.tokens.in_memory():
        return True
    mask, start = e.mask, 0
    for n, k in e.samples:
        if mask[start : start + n].count(1) != k:
            return False
        start += n
    return True


def _store_as_float(event: Event, *names: str) -> None:
    """A float field given another number (an int, a numpy scalar) holds the float it is: the
    event and its decoded copy are then equal and write the same bytes. ValueError (one line)
    for a value that is no number."""
    for name in names:
        value = getattr(event, name)
        if type(value) is not float:
            try:
                msgspec.structs.force_setattr(event, name, float(value))
            except (TypeError, ValueError):
                raise ValueError(f"{event.kind}.{name} must be a number, got {value!r}") from None


def version_runs(versions: Iterable[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """The canonical `token_versions` of consecutive (version, tokens) segments: adjacent
    segments of one version merged, empty ones left out, and no runs at all where a single
    version sampled every token (then policy_start and policy_end say it)."""
    runs: list[tuple[int, int]] = []
    for version, count in versions:
        if count <= 0:
            continue
        if runs and runs[-1][0] == version:
            runs[-1] = (version, runs[-1][1] + count)
        else:
            runs.append((version, count))
    return tuple(runs) if len(runs) > 1 else ()


def check_version_runs(runs: tuple[tuple[int, int], ...], sampled: int, start: int, end: int) -> None:
    """ValueError (one line) unless `runs` are canonical `token_versions` of `sampled` tokens
    whose oldest version is `start` and newest `end`."""
    if len(runs) < 2 or any(a[0] == b[0] for a, b in zip(runs, runs[1:])) or any(n <= 0 for _, n in runs):
        raise ValueError(f"token_versions {runs} are not runs of two or more versions (version_runs)")
    if sum(n for _, n in runs) != sampled:
        raise ValueError(f"token_versions count {sum(n for _, n in runs)} tokens where {sampled} were sampled")
    versions = [v for v, _ in runs]
    if (min(versions), max(versions)) != (start, end):
        raise ValueError(
            f"token_versions span versions {min(versions)}..{max(versions)}, the episode says {start}..{end}"
        )


class EpisodeCancelled(Event, frozen=True, kw_only=True):
    role = "decision"
    kind = "episode_cancelled"
    episode_id: int
    reason: Literal["drain", "stop", "resume", "group_cancelled"]


class FinalizeStarted(Event, frozen=True, kw_only=True):
    role = "decision"
    kind = "finalize_started"
    group_id: int
    background: bool
    episode_ids: list[int]


class GroupFinalized(Event, frozen=True, kw_only=True):
    role = "decision"
    kind = "group_finalized"
    group_id: int
    episode_ids: list[int]
    advantages: list[float]
    # [sample id, advantage] of the samples of agents the env scored apart (`agent_rewards`):
    # each agent scored against the same agent's rewards across the group. The other samples
    # take their episode's advantage. Left out while empty.
    sample_advantages: list[tuple[int, float]] = []


class BackgroundFinalized(Event, frozen=True, kw_only=True):
    """A background finalize's result: what `group_finalized` decides on the inline path."""

    role = "input"

    kind = "background_finalized"
    group_id: int
    episode_ids: list[int]
    advantages: list[float]


class FinalizeFailed(Event, frozen=True, kw_only=True):
    role = "input"
    kind = "finalize_failed"
    group_id: int
    error: str


# Why completed samples never train: a settled group's drops, a group_cancelled's or a
# traces_dropped's reason (`core.state.DROP_REASONS` says which are waste).
DropReason = Literal[
    "stale", "rejected", "zero_advantage", "failed", "no_output", "overload", "damaged", "drain", "stop"
]


class GroupSettled(Event, frozen=True, kw_only=True):
    role = "decision"
    kind = "group_settled"
    group_id: int
    admitted: bool
    sample_ids: list[int]  # the samples inserted into the pending queue, in order
    dropped: dict[DropReason, list[int]] = {}  # reason -> completed episodes not queued


class GroupCancelled(Event, frozen=True, kw_only=True):
    role = "decision"
    kind = "group_cancelled"
    group_id: int
    reason: Literal["stale", "overload", "drain", "stop", "damaged"]
    count: int  # completed episodes of the group that will never train


class TracesDropped(Event, frozen=True, kw_only=True):
    role = "decision"
    kind = "traces_dropped"
    trace_ids: list[int]
    reason: Literal["stale", "drain", "stop", "damaged"]


class GateChanged(Event, frozen=True, kw_only=True):
    role = "decision"
    kind = "gate_changed"
    open: bool
    reason: str


class VersionPublished(Event, frozen=True, kw_only=True):
    role = "input"
    kind = "version_published"
    version: int
    # The trainer's figures for the step that made this version (rundir.TRAINER_METRICS), as it
    # reported them; None where it reported none. No rule reads them.
    metrics: dict[str, int | float] | None = None


class BatchShipped(Event, frozen=True, kw_only=True):
    role = "decision"
    kind = "batch_shipped"
    step: int
    sample_ids: list[int]  # shipped, in batch order
    pruned_ids: list[int] = []  # cut but zero-advantage, so not shipped
    sha256: str
    n_tokens: int
    off_policy_max: int
    off_policy_mean: float
    reward_mean: float


# --- evaluations (docs/evals.md): their own events, apart from the train traffic ----------------


class EvalStarted(Event, frozen=True, kw_only=True):
    """Decision: evaluate `env` at `version` (pinned) on its held-out tasks. Task i of the eval is
    group `first_group_id + i`, sampled `samples_per_task` times."""

    role = "decision"

    kind = "eval_started"
    eval_id: int
    env: str
    version: int
    task_ids: list[int]
    first_group_id: int
    samples_per_task: int
    temperature: float


class EvalEpisodeDispatched(Event, frozen=True, kw_only=True):
    """Decision: sample `sample` (task `sample // samples_per_task`) of an eval, pinned to `policy_version`."""

    role = "decision"

    kind = "eval_episode_dispatched"
    episode_id: int
    eval_id: int
    group_id: int
    task_id: int
    sample: int
    attempt: int
    policy_version: int


class EvalEpisodeCompleted(Event, frozen=True, kw_only=True):
    """Input: an eval episode's result. No token ids: an eval is never trained on, so only what
    its figures need is logged. `success` is the env's success notion (None: it has none)."""

    role = "input"

    kind = "eval_episode_completed"
    episode_id: int
    eval_id: int
    ok: bool
    reward: float
    success: bool | None = None
    sampled_tokens: int = 0
    policy_start: int
    policy_end: int
    error: str | None = None

    def __post_init__(self) -> None:
        _store_as_float(self, "reward")


class EvalEpisodeCancelled(Event, frozen=True, kw_only=True):
    """Decision: an eval episode's rollout is cancelled (stop) or lost (resume); either way its
    eval stays open and the sample is taken again when the run goes on."""

    role = "decision"

    kind = "eval_episode_cancelled"
    episode_id: int
    reason: Literal["stop", "resume"]


class EvalCompleted(Event, frozen=True, kw_only=True):
    """Decision: an eval's result, from the samples taken by its pinned version (`scored`).
    pass@1 is the success rate; pass@k (k = samples_per_task) the share of tasks with a success
    among their scored samples; both None for an env without a success notion. `off_version`
    samples were taken by another version: counted, never mixed into the figures."""

    role = "decision"

    kind = "eval_completed"
    eval_id: int
    env: str
    version: int
    tasks: int
    k: int
    scored: int
    failures: int
    off_version: int
    reward_mean: float | None
    pass_at_1: float | None
    pass_at_k: float | None
    tokens: int


class DrainStarted(Event, frozen=True, kw_only=True):
    role = "decision"
    kind = "drain_started"
    reason: str


class StopRequested(Event, frozen=True, kw_only=True):
    role = "input"
    kind = "stop_requested"
    reason: str


class TrainerRestarted(Event, frozen=True, kw_only=True):
    """Input: the trainer process died (`cause`: its signal or exit code, its last error line) and
    was started again from its checkpoint, the `attempt`-th time in this run. Recorded for
    `orch replay`; it changes nothing the core decides (docs/resume.md)."""

    role = "input"
    kind = "trainer_restarted"
    attempt: int
    cause: str


class EndpointChanged(Event, frozen=True, kw_only=True):
    """Input: an inference server orch launched went down (`up` false: it exited, its `cause` the
    exit code and its log's last line, or it missed its health deadline) or came back after a
    restart (`up` true; `attempt`: the restart). Recorded for `orch replay`; it changes nothing the
    core decides (docs/vllm.md)."""

    role = "input"
    kind = "endpoint_changed"
    url: str
    up: bool
    attempt: int
    cause: str


class RunStopped(Event, frozen=True, kw_only=True):
    role = "decision"
    kind = "run_stopped"
    reason: str
    error: bool = False


EVENT_TYPES: dict[str, type[Event]] = {
    cls.kind: cls
    for cls in (
        RunStarted,
        RunResumed,
        GroupDispatched,
        EpisodeDispatched,
        EpisodeCompleted,
        EpisodeCancelled,
        FinalizeStarted,
        GroupFinalized,
        BackgroundFinalized,
        FinalizeFailed,
        GroupSettled,
        GroupCancelled,
        TracesDropped,
        GateChanged,
        VersionPublished,
        BatchShipped,
        DrainStarted,
        StopRequested,
        TrainerRestarted,
        EndpointChanged,
        RunStopped,
        EvalStarted,
        EvalEpisodeDispatched,
        EvalEpisodeCompleted,
        EvalEpisodeCancelled,
        EvalCompleted,
    )
}
assert all(getattr(cls, "role", None) in ("input", "decision") for cls in EVENT_TYPES.values()), "a kind lacks a role"
# Facts from the outside world; everything else is decided by the core.
INPUT_KINDS = frozenset(kind for kind, cls in EVENT_TYPES.items() if cls.role == "input")


# `run_started`'s params are the run's settings, a pydantic model validated with the config:
# written as their JSON, read back through their validation. NotImplementedError is msgspec's
# protocol for a hook given a type it does not handle (msgspec reports it as an unsupported type).
def _encode_params(value: Any) -> Any:
    if isinstance(value, CoreParams):
        return value.model_dump(mode="json")
    raise NotImplementedError(f"an event field of type {type(value).__name__}")


def _decode_params(cls: type, value: Any) -> Any:
    if cls is CoreParams:
        return CoreParams.model_validate(value)
    raise NotImplementedError(f"an event field of type {cls.__name__}")


_ENCODER = msgspec.json.Encoder(enc_hook=_encode_params)
# kind -> its rows' decoder (JSON data -> the event, type-checked; ValueError for bad data).
DECODERS = {kind: msgspec.json.Decoder(cls, dec_hook=_decode_params).decode for kind, cls in EVENT_TYPES.items()}
E = TypeVar("E", bound=Event)


def checked(cls: type[E], **fields: Any) -> E:
    """`cls(**fields)`, each field checked against its type, and no float NaN or infinite (JSON
    has neither) (ValueError, one line): for events built from values that come from outside (an
    env's episode, an algorithm's advantages, a trainer's figures)."""
    try:
        event = msgspec.convert({name: _plain(value) for name, value in fields.items()}, cls, dec_hook=_decode_params)
    except msgspec.ValidationError as err:
        raise ValueError(f"{cls.kind}: {err}") from None
    for name in cls.__struct_fields__:
        _refuse_non_finite(getattr(event, name), f"{cls.kind}.{name}")
    return event


def checked_episode(episode: Any) -> EpisodeCompleted:
    """An episode as an env or a backend made it, checked as `checked` does, its arrays in memory
    (ValueError, one line): what the log is given is what it can fold back."""
    if not isinstance(episode, EpisodeCompleted):
        raise ValueError(f"an episode is an EpisodeCompleted, got {type(episode).__name__}")
    if episode.tokens is not None and not episode.tokens.in_memory():
        raise ValueError("episode_completed.tokens holds sizes without arrays: build it with Tokens.of")
    return checked(EpisodeCompleted, **{name: getattr(episode, name) for name in episode.__struct_fields__})


def _plain(value: Any) -> Any:
    """Numpy's scalars and arrays as the Python values they hold (an env's reward from np.mean,
    an algorithm's advantages as an ndarray); other values as they are."""
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (str, bytes, Tokens)) or not hasattr(value, "tolist"):
        return value
    return value.tolist()


def _refuse_non_finite(value: Any, where: str) -> None:
    if type(value) is float:
        if not math.isfinite(value):
            raise ValueError(f"{where} is {value}: it must be finite")
    elif isinstance(value, (list, tuple)):
        for item in value:
            _refuse_non_finite(item, where)
    elif isinstance(value, dict):
        for key, item in value.items():
            _refuse_non_finite(item, f"{where}.{key}")


def encode_event(event: Event) -> tuple[str, bytes, bytes | None]:
    """(kind, data JSON, payload) as stored in the log: the fields, and the packed token arrays
    of an `episode_completed` with tokens (None for every other event)."""
    data = _ENCODER.encode(event)
    if event.kind == "episode_completed" and event.tokens is not None and event.tokens.n_tokens:  # type: ignore[attr-defined]
        return event.kind, data, event.tokens.packed()  # type: ignore[attr-defined]
    return event.kind, data, None


def logged_n_tokens(fields: Any) -> int | None:
    """The token count an `episode_completed` row's JSON fields give (`tokens`, [n_tokens,
    sampled_tokens]): what its payload's size follows from; None where they give none."""
    tokens = fields.get("tokens") if isinstance(fields, dict) else None
    if isinstance(tokens, list) and tokens and type(tokens[0]) is int:
        return tokens[0]
    return None


def decode_event(kind: str, data: bytes | str, payload: bytes | None = None) -> Event:
    """The event of a log row, each field type-checked, with its arrays from `payload` (an
    `episode_completed`'s; without it they are not read); ValueError (msgspec's, or PayloadError)
    on an unknown kind or bad data."""
    try:
        decode = DECODERS[kind]
    except KeyError:
        raise ValueError(f"unknown event kind {kind!r}") from None
    event = decode(data)
    if payload is not None and event.kind == "episode_completed" and event.tokens is not None:  # type: ignore[attr-defined]
        event.tokens.attach(payload)  # type: ignore[attr-defined]
        event.tokens.arrays()  # type: ignore[attr-defined]  # checked now: PayloadError
    return event


def with_arrays(trace: Any) -> dict[str, Any]:
    """An episode's (or a sample's, `samples.Sample`) fields, every one, with its arrays as lists
    in place of `tokens`: how `orch replay --episode` shows it."""
    fields = {name: getattr(trace, name) for name in trace.__struct_fields__ if name != "tokens"}
    return {
        **fields,
        "token_ids": trace.token_ids.tolist(),
        "mask": list(trace.mask),
        "logprobs": trace.logprobs.tolist(),
    }
