"""The event catalogue (docs/log-format.md): one pydantic model per kind, a discriminated union on `kind`.

An event is either an *input* (a fact from the outside world: a finished episode, a background
finalize result, a published version, a stop request, a start/resume marker) or a *decision*
that `decide` derived from one, and its kind says which: each event class's `role` (the kinds
whose role is "input" are `INPUT_KINDS`). Both are logged; `evolve` folds both. A group scored
inline is the decision `group_finalized`; the same result from a background finalize is the input
`background_finalized`.

In the log, `kind` is the column and `data` is the model's JSON without `kind`. The constructors
that skip validation (`Event.unvalidated`) and the fold views are in `_fast_events`.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal, Self

import orjson
import pydantic_core
from pydantic import BaseModel, ConfigDict, Field, PlainSerializer, PlainValidator, TypeAdapter, model_validator

from orchestrator.core import arrays
from orchestrator.core.advantages import INLINE_SCORERS

# The event format's version: raised with every change to what an event's row holds, so that a log
# is read only by the code that knows its format; what each version changed is in
# docs/log-format.md, "Version history", and a log of another version is refused.
EVENT_SCHEMA_VERSION = 5


def check_schema_version(version: int | str) -> None:
    """ValueError (one line, naming the version) for a log this code does not read."""
    if str(version) != str(EVENT_SCHEMA_VERSION):
        raise ValueError(
            f"an orch log of format version {version}; this orch reads version {EVENT_SCHEMA_VERSION} "
            'only (docs/log-format.md, "Version history")'
        )


class _Model(BaseModel):
    # Frozen: the same object lives in the log buffer and in the state. NaN/Inf are refused at
    # construction, so an encoded event is always valid JSON.
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)
    if TYPE_CHECKING:
        kind: str  # an event's discriminator: a Literal field of each event class
    # `cls(**fields)` without validation, for values valid by construction; every event class
    # gets its own (`_fast_events.unvalidated_constructor`).
    unvalidated: ClassVar[Callable[..., Self]]
    # An event's role: "input" (a fact from the outside world, handed to `decide`) or "decision"
    # (what `decide` derived from one). A class attribute rather than two base classes: a deeper
    # class hierarchy slows every attribute lookup of the core.
    role: ClassVar[Literal["input", "decision"]]


class EvalParams(_Model):
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


class CoreParams(_Model):
    """Every knob of the rules in docs/rules.md. Carried by `run_started`, so a log folds on its own."""

    seed: int = Field(0, description="seeds env choice and everything random in the core")
    env_ratios: dict[str, float] = Field(
        default_factory=lambda: {"reverse_text": 1.0},
        description="train envs and their dispatch ratios (chosen with the seeded RNG)",
    )
    group_size: int = Field(8, ge=1, description="episodes per group (one task)")
    batch_size: int = Field(64, ge=1, description="traces per batch (trace batching)")
    token_batch_size: int | None = Field(None, ge=1, description="if set, cut batches by tokens instead of traces")
    constant_trainer_batch_size: bool = Field(
        False, description="prune zero-advantage samples before the cut, so every batch is full"
    )
    max_inflight: int = Field(64, ge=1, description="in-flight episode permits")
    target_lag: int = Field(1, ge=0, description="batch N ships once version >= N-1-target_lag")
    max_off_policy_steps: int = Field(
        2, ge=0, description="traces older than (step-1)-max_off_policy_steps are dropped"
    )
    max_finalizing_groups: int = Field(
        64, ge=1, description="background-finalizing groups (per env) that close the dispatch gate"
    )
    max_steps: int = Field(20, ge=1, description="batches to ship before draining")
    algorithm: str = Field("grpo", description="the algorithm's name (`algorithm.name`)")
    finalize_in_background: bool = Field(
        False, description="resolved from the algorithm's class flag and the config override"
    )
    # grpo's setting, as its section puts it here (`AlgorithmComponent.core_settings`). Left out
    # of the JSON while off (GRPO's advantages as they always were): the digests hold.
    std_normalization: bool = Field(
        False, exclude_if=lambda value: not value, description="grpo: advantages divided by the group's std"
    )
    zero_output_batches: int = Field(
        10, ge=1, description="batch-equivalents of zero output in a row that stop the run"
    )
    # Rule 1 (d). A `run_started` written before the rule has no such field and means "off", the
    # behaviour it was recorded with; so "off" is written as no field at all, and a log with the
    # rule off stays byte for byte a log of the code before it. New runs get "staleness" from
    # the config's default.
    capacity: Literal["off", "staleness"] = Field(
        "off",
        exclude_if=lambda value: value == "off",
        description="staleness: start a group only while the work dispatched and not yet shipped "
        "or dropped can still train in the steps that would accept it; off: max_inflight alone",
    )
    # Rule 6 and the batch file (docs/rules.md, "Samples"). Left out of the JSON at the value a
    # log written before them means (the cut by prefix; one-sample episodes, each weighing 1).
    batch_cut: Literal["prefix", "groups"] = Field(
        "prefix",
        exclude_if=lambda value: value == "prefix",
        description="groups: a batch takes whole groups (a group's samples never split across batches); "
        "prefix: the oldest batch_size samples, a group split at the edge",
    )
    sample_weight: Literal["episode", "sample"] = Field(
        "episode",
        exclude_if=lambda value: value == "episode",
        description="each sample's loss weight: episode: 1/N for the N samples of an episode, so an episode "
        "weighs the same however many samples it has; sample: 1 each",
    )
    # Left out of the JSON while None: a run without evals logs the `run_started` it always did.
    eval: EvalParams | None = Field(
        None, exclude_if=lambda value: value is None, description="evaluations on a schedule (None: none)"
    )

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


class RunStarted(_Model):
    role = "input"
    kind: Literal["run_started"] = Field("run_started", exclude=True)
    schema_version: int = EVENT_SCHEMA_VERSION
    params: CoreParams


class RunResumed(_Model):
    role = "input"
    kind: Literal["run_resumed"] = Field("run_resumed", exclude=True)
    from_seq: int
    max_steps: int
    # `orch run --resume --drop-damaged`: held traces, never shipped, whose token payloads are lost
    # (a side file missing or damaged); the resume drops them first. Left out of the JSON while
    # empty: a resume without damage logs the `run_resumed` it always did.
    damaged_traces: list[int] = Field([], exclude_if=lambda value: not value)


class GroupDispatched(_Model):
    role = "decision"
    kind: Literal["group_dispatched"] = Field("group_dispatched", exclude=True)
    group_id: int
    env: str
    task_id: int
    group_size: int
    policy_version: int


class EpisodeDispatched(_Model):
    role = "decision"
    kind: Literal["episode_dispatched"] = Field("episode_dispatched", exclude=True)
    episode_id: int
    group_id: int
    attempt: int
    policy_version: int


# A trace's arrays, packed (orchestrator.core.arrays): validated at the boundary, JSON lists only
# where a model is dumped as JSON (the log stores them as a payload: `encode_event`).
TokenIds = Annotated[array, PlainValidator(arrays.as_token_ids), PlainSerializer(array.tolist, when_used="json")]
Mask = Annotated[bytes, PlainValidator(arrays.as_mask), PlainSerializer(list, when_used="json")]
Logprobs = Annotated[array, PlainValidator(arrays.as_logprobs), PlainSerializer(array.tolist, when_used="json")]


class EpisodeCompleted(_Model):
    role = "input"
    kind: Literal["episode_completed"] = Field("episode_completed", exclude=True)
    episode_id: int
    group_id: int
    ok: bool
    reward: float = 0.0
    token_ids: TokenIds = Field(default_factory=lambda: array(arrays.TOKEN_ID_CODE))
    mask: Mask = b""
    logprobs: Logprobs = Field(default_factory=lambda: array(arrays.LOGPROB_CODE))
    policy_start: int
    policy_end: int
    temperature: float = 1.0
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

    @model_validator(mode="after")
    def _aligned(self) -> EpisodeCompleted:
        if not (len(self.token_ids) == len(self.mask) == len(self.logprobs)):
            raise ValueError("token_ids, mask and logprobs must have the same length")
        if self.token_versions:
            check_version_runs(self.token_versions, self.mask.count(1), self.policy_start, self.policy_end)
        if self.samples or self.agents or self.agent_rewards:
            check_samples(self)
        return self

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def sampled_tokens(self) -> int:
        return self.mask.count(1)


# Sample k of episode e is named `e + k * SAMPLE_ID_STRIDE`: sample 0 is the episode's own id, so
# a one-sample episode's sample is named as its episode always was (docs/log-format.md, "Samples").
SAMPLE_ID_STRIDE = 10**12


def sample_id(episode_id: int, index: int) -> int:
    """The id of sample `index` of episode `episode_id` (its trace id in the queue and batches)."""
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
        if sum(n for n, _ in e.samples) != len(e.token_ids):
            raise ValueError(
                f"samples count {sum(n for n, _ in e.samples)} tokens where the episode has {len(e.token_ids)}"
            )
        start = 0
        for n, k in e.samples:
            if e.mask[start : start + n].count(1) != k:
                raise ValueError(f"samples {list(e.samples)} do not match the mask's sampled tokens")
            start += n
    if e.agents and len(e.agents) != max(1, len(e.samples)):
        raise ValueError(f"agents names {len(e.agents)} samples where the episode has {max(1, len(e.samples))}")
    scored = [name for name, _ in e.agent_rewards]
    if e.agent_rewards and (len(set(scored)) != len(scored) or set(scored) != set(e.agents)):
        raise ValueError(f"agent_rewards scores {scored}, the samples' agents are {sorted(set(e.agents))}")


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
            f"token_versions span versions {min(versions)}..{max(versions)}, the trace says {start}..{end}"
        )


class EpisodeCancelled(_Model):
    role = "decision"
    kind: Literal["episode_cancelled"] = Field("episode_cancelled", exclude=True)
    episode_id: int
    reason: Literal["drain", "stop", "resume", "group_cancelled"]


class FinalizeStarted(_Model):
    role = "decision"
    kind: Literal["finalize_started"] = Field("finalize_started", exclude=True)
    group_id: int
    background: bool
    trace_ids: list[int]


class GroupFinalized(_Model):
    role = "decision"
    kind: Literal["group_finalized"] = Field("group_finalized", exclude=True)
    group_id: int
    trace_ids: list[int]
    advantages: list[float]
    # [sample id, advantage] of the samples of agents the env scored apart (`agent_rewards`):
    # each agent scored against the same agent's rewards across the group. The other samples
    # take their episode's advantage. Left out while empty.
    sample_advantages: list[tuple[int, float]] = Field([], exclude_if=lambda value: not value)


class BackgroundFinalized(_Model):
    """A background finalize's result: what `group_finalized` decides on the inline path."""

    role = "input"

    kind: Literal["background_finalized"] = Field("background_finalized", exclude=True)
    group_id: int
    trace_ids: list[int]
    advantages: list[float]


class FinalizeFailed(_Model):
    role = "input"
    kind: Literal["finalize_failed"] = Field("finalize_failed", exclude=True)
    group_id: int
    error: str


# Why completed samples never train: a settled group's drops, a group_cancelled's or a
# traces_dropped's reason (`core.state.DROP_REASONS` says which are waste).
DropReason = Literal[
    "stale", "rejected", "zero_advantage", "failed", "no_output", "overload", "damaged", "drain", "stop"
]


class GroupSettled(_Model):
    role = "decision"
    kind: Literal["group_settled"] = Field("group_settled", exclude=True)
    group_id: int
    admitted: bool
    trace_ids: list[int]  # the traces inserted into the pending queue, in order
    dropped: dict[DropReason, list[int]] = Field(default_factory=dict)  # reason -> completed episodes not queued


class GroupCancelled(_Model):
    role = "decision"
    kind: Literal["group_cancelled"] = Field("group_cancelled", exclude=True)
    group_id: int
    reason: Literal["stale", "overload", "drain", "stop", "damaged"]
    count: int  # completed episodes of the group that will never train


class TracesDropped(_Model):
    role = "decision"
    kind: Literal["traces_dropped"] = Field("traces_dropped", exclude=True)
    trace_ids: list[int]
    reason: Literal["stale", "drain", "stop", "damaged"]


class GateChanged(_Model):
    role = "decision"
    kind: Literal["gate_changed"] = Field("gate_changed", exclude=True)
    open: bool
    reason: str


class VersionPublished(_Model):
    role = "input"
    kind: Literal["version_published"] = Field("version_published", exclude=True)
    version: int
    # The trainer's figures for the step that made this version (rundir.TRAINER_METRICS), as it
    # reported them; None before a trainer reported any (and in older logs). No rule reads them.
    metrics: dict[str, int | float] | None = None


class BatchShipped(_Model):
    role = "decision"
    kind: Literal["batch_shipped"] = Field("batch_shipped", exclude=True)
    step: int
    trace_ids: list[int]  # shipped, in batch order
    pruned_ids: list[int] = Field(default_factory=list)  # cut but zero-advantage, so not shipped
    sha256: str
    n_tokens: int
    off_policy_max: int
    off_policy_mean: float
    reward_mean: float


# --- evaluations (docs/evals.md): their own events, apart from the train traffic ----------------


class EvalStarted(_Model):
    """Decision: evaluate `env` at `version` (pinned) on its held-out tasks. Task i of the eval is
    group `first_group_id + i`, sampled `samples_per_task` times."""

    role = "decision"

    kind: Literal["eval_started"] = Field("eval_started", exclude=True)
    eval_id: int
    env: str
    version: int
    task_ids: list[int]
    first_group_id: int
    samples_per_task: int
    temperature: float


class EvalEpisodeDispatched(_Model):
    """Decision: sample `sample` (task `sample // samples_per_task`) of an eval, pinned to `policy_version`."""

    role = "decision"

    kind: Literal["eval_episode_dispatched"] = Field("eval_episode_dispatched", exclude=True)
    episode_id: int
    eval_id: int
    group_id: int
    task_id: int
    sample: int
    attempt: int
    policy_version: int


class EvalEpisodeCompleted(_Model):
    """Input: an eval episode's result. No token ids: an eval is never trained on, so only what
    its figures need is logged. `success` is the env's success notion (None: it has none)."""

    role = "input"

    kind: Literal["eval_episode_completed"] = Field("eval_episode_completed", exclude=True)
    episode_id: int
    eval_id: int
    ok: bool
    reward: float = 0.0
    success: bool | None = None
    sampled_tokens: int = 0
    policy_start: int
    policy_end: int
    error: str | None = None


class EvalEpisodeCancelled(_Model):
    """Decision: an eval episode's rollout is cancelled (stop) or lost (resume); either way its
    eval stays open and the sample is taken again when the run goes on."""

    role = "decision"

    kind: Literal["eval_episode_cancelled"] = Field("eval_episode_cancelled", exclude=True)
    episode_id: int
    reason: Literal["stop", "resume"]


class EvalCompleted(_Model):
    """Decision: an eval's result, from the samples taken by its pinned version (`scored`).
    pass@1 is the success rate; pass@k (k = samples_per_task) the share of tasks with a success
    among their scored samples; both None for an env without a success notion. `off_version`
    samples were taken by another version: counted, never mixed into the figures."""

    role = "decision"

    kind: Literal["eval_completed"] = Field("eval_completed", exclude=True)
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


class DrainStarted(_Model):
    role = "decision"
    kind: Literal["drain_started"] = Field("drain_started", exclude=True)
    reason: str


class StopRequested(_Model):
    role = "input"
    kind: Literal["stop_requested"] = Field("stop_requested", exclude=True)
    reason: str


class TrainerRestarted(_Model):
    """Input: the trainer process died (`cause`: its signal or exit code, its last error line) and
    was started again from its checkpoint, the `attempt`-th time in this run. Recorded for
    `orch replay`; it changes nothing the core decides (docs/resume.md)."""

    role = "input"
    kind: Literal["trainer_restarted"] = Field("trainer_restarted", exclude=True)
    attempt: int
    cause: str


class EndpointChanged(_Model):
    """Input: an inference server orch launched went down (`up` false: it exited, its `cause` the
    exit code and its log's last line, or it missed its health deadline) or came back after a
    restart (`up` true; `attempt`: the restart). Recorded for `orch replay`; it changes nothing the
    core decides (docs/vllm.md)."""

    role = "input"
    kind: Literal["endpoint_changed"] = Field("endpoint_changed", exclude=True)
    url: str
    up: bool
    attempt: int
    cause: str


class RunStopped(_Model):
    role = "decision"
    kind: Literal["run_stopped"] = Field("run_stopped", exclude=True)
    reason: str
    error: bool = False


Event = Annotated[
    RunStarted
    | RunResumed
    | GroupDispatched
    | EpisodeDispatched
    | EpisodeCompleted
    | EpisodeCancelled
    | FinalizeStarted
    | GroupFinalized
    | BackgroundFinalized
    | FinalizeFailed
    | GroupSettled
    | GroupCancelled
    | TracesDropped
    | GateChanged
    | VersionPublished
    | BatchShipped
    | DrainStarted
    | StopRequested
    | TrainerRestarted
    | EndpointChanged
    | RunStopped
    | EvalStarted
    | EvalEpisodeDispatched
    | EvalEpisodeCompleted
    | EvalEpisodeCancelled
    | EvalCompleted,
    Field(discriminator="kind"),
]
EVENT_ADAPTER: TypeAdapter[Event] = TypeAdapter(Event)
EVENT_TYPES: dict[str, type[_Model]] = {
    cls.model_fields["kind"].default: cls
    for cls in Event.__origin__.__args__  # type: ignore[attr-defined]
}
# Facts from the outside world; everything else is decided by the core.
assert all(getattr(cls, "role", None) in ("input", "decision") for cls in EVENT_TYPES.values()), "a kind lacks a role"
INPUT_KINDS = frozenset(kind for kind, cls in EVENT_TYPES.items() if cls.role == "input")

# Kinds encoded and decoded by pydantic itself: a nested model (run_started's params), or a field
# left out of the JSON while empty (`exclude_if`, which the orjson path below does not know:
# run_resumed's damaged_traces). Both are rare rows.
_NESTED_KINDS = frozenset({"run_started", "run_resumed"})
# An event's fields are its __dict__, `kind` first, in declaration order, so its data is the
# orjson encoding of that dict minus the `{"kind":"...",` head: byte for byte what pydantic's
# serializer writes (a property test checks it), at a fraction of the cost. What orjson refuses
# goes through pydantic, which encodes big ints and names an unset field.
_KIND_HEAD_LENGTH = {kind: len(orjson.dumps({"kind": kind})) for kind in EVENT_TYPES}
# Fields of flat kinds left out of the JSON while empty (`exclude_if`): the fast path leaves them
# out itself.
_OMITTED_WHILE_EMPTY = {"group_finalized": "sample_advantages"}
_FIELDS_JSON: TypeAdapter[dict[str, Any]] = TypeAdapter(dict[str, Any])


def episode_fields(e: EpisodeCompleted) -> dict[str, Any]:
    """An `episode_completed` row's JSON fields: its scalars, with `n_tokens` and
    `sampled_tokens` where the packed arrays are (`arrays.pack` makes its payload), and its
    `token_versions` only where it has some (a trace of one version logs what it always did)."""
    return {
        "episode_id": e.episode_id,
        "group_id": e.group_id,
        "ok": e.ok,
        "reward": e.reward,
        "n_tokens": len(e.token_ids),
        "sampled_tokens": e.mask.count(1),
        "policy_start": e.policy_start,
        "policy_end": e.policy_end,
        "temperature": e.temperature,
        "error": e.error,
        **({"token_versions": e.token_versions} if e.token_versions else {}),
        **({"samples": e.samples} if e.samples else {}),
        **({"agents": e.agents} if e.agents else {}),
        **({"agent_rewards": e.agent_rewards} if e.agent_rewards else {}),
    }


def episode_from_fields(fields: dict[str, Any], payload: bytes | None, validate: bool = True) -> EpisodeCompleted:
    """The `EpisodeCompleted` of a row's JSON fields and payload; ValueError (`arrays.PayloadError`)
    if the payload does not hold the `n_tokens` and `sampled_tokens` the fields say."""
    fields = dict(fields)
    n_tokens, sampled = fields.pop("n_tokens"), fields.pop("sampled_tokens")
    token_ids, mask, logprobs = arrays.unpack(payload, n_tokens)
    if mask.count(1) != sampled:
        raise arrays.PayloadError(f"a payload with {mask.count(1)} sampled tokens where its event says {sampled}")
    fields.update(token_ids=token_ids, mask=mask, logprobs=logprobs)
    for name in ("token_versions", "samples", "agent_rewards"):  # JSON lists: the pairs are tuples
        if name in fields:
            fields[name] = tuple(tuple(pair) for pair in fields[name])
    if "agents" in fields:
        fields["agents"] = tuple(fields["agents"])
    if validate:
        return EpisodeCompleted.model_validate(fields)
    return EpisodeCompleted.unvalidated(**fields)


def encode_event(event: _Model) -> tuple[str, bytes, bytes | None]:
    """(kind, data JSON, payload) as stored in the log: the fields without `kind`, and the packed
    token arrays of an `episode_completed` with tokens (None for every other event)."""
    kind = event.kind
    if kind == "episode_completed":
        e: EpisodeCompleted = event  # type: ignore[assignment]
        fields = episode_fields(e)
        try:
            data = orjson.dumps(fields)
        except orjson.JSONEncodeError:  # an int beyond 64 bits
            data = _FIELDS_JSON.dump_json(fields)
        return kind, data, arrays.pack(e.token_ids, e.mask, e.logprobs) or None
    if kind not in _NESTED_KINDS:
        fields = event.__dict__
        omitted = _OMITTED_WHILE_EMPTY.get(kind)
        if omitted is not None and not fields[omitted]:
            fields = {name: value for name, value in fields.items() if name != omitted}
        try:
            return kind, b"{" + orjson.dumps(fields)[_KIND_HEAD_LENGTH[kind] :], None
        except orjson.JSONEncodeError:  # an int beyond 64 bits, or a field left unset
            pass
    return kind, event.__pydantic_serializer__.to_json(event), None


def decode_event(kind: str, data: bytes | str, payload: bytes | None = None) -> _Model:
    """The event model for a log row (its payload, for an `episode_completed`); raises
    ValueError on an unknown kind or bad data."""
    try:
        cls = EVENT_TYPES[kind]
    except KeyError:
        raise ValueError(f"unknown event kind {kind!r}") from None
    if kind == "episode_completed":
        return episode_from_fields(pydantic_core.from_json(data), payload)  # any int, as pydantic reads one
    return cls.model_validate_json(data)
