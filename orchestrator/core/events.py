"""The event catalogue (docs/log-format.md): one pydantic model per kind, a discriminated union on `kind`.

An event is either an *input* (a fact from the outside world: a finished episode, a background
finalize result, a published version, a stop request, a start/resume marker) or a *decision*
that `decide` derived from one. Both are logged; `evolve` folds both.

In the log, `kind` is the column and `data` is the model's JSON without `kind`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Annotated, ClassVar, Literal, Self, Union

import msgspec
import orjson
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, model_validator

from orchestrator.core.algorithms import BACKGROUND_ONLY, KNOWN_ALGORITHMS

EVENT_SCHEMA_VERSION = 1


class _Model(BaseModel):
    # Frozen: the same object lives in the log buffer and in the state. NaN/Inf are refused at
    # construction, so an encoded event is always valid JSON.
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)
    # Every event class gets its own (see `_trusted_constructor`).
    trusted: ClassVar[Callable[..., Self]]


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
    token_batch_size: int | None = Field(
        None, ge=1, description="if set, cut batches by tokens instead of traces"
    )
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
    algorithm: str = Field("grpo", description="grpo | gar")
    finalize_in_background: bool = Field(
        False, description="resolved from the algorithm's class flag and the config override"
    )
    zero_output_batches: int = Field(
        10, ge=1, description="batch-equivalents of zero output in a row that stop the run"
    )
    # Left out of the JSON while None: a run without evals logs the `run_started` it always did.
    eval: EvalParams | None = Field(None, exclude_if=lambda value: value is None,
                                    description="evaluations on a schedule (None: none)")

    @model_validator(mode="after")
    def _check(self) -> CoreParams:
        if not self.env_ratios or any(r <= 0 for r in self.env_ratios.values()):
            raise ValueError("env_ratios must name at least one env, each with a ratio > 0")
        if self.algorithm not in KNOWN_ALGORITHMS:
            raise ValueError(f"unknown algorithm {self.algorithm!r}; known: {sorted(KNOWN_ALGORITHMS)}")
        if self.algorithm in BACKGROUND_ONLY and not self.finalize_in_background:
            raise ValueError(f"algorithm {self.algorithm!r} calls a grader and must finalize in the background")
        if self.eval is not None and not set(self.eval.envs) <= set(self.env_ratios):
            raise ValueError(f"eval envs {self.eval.envs} must be train envs ({list(self.env_ratios)}): "
                             "their rollouts run on the train envs' backends")
        return self


class RunStarted(_Model):
    kind: Literal["run_started"] = Field("run_started", exclude=True)
    schema_version: int = EVENT_SCHEMA_VERSION
    params: CoreParams


class RunResumed(_Model):
    kind: Literal["run_resumed"] = Field("run_resumed", exclude=True)
    from_seq: int
    max_steps: int


class GroupDispatched(_Model):
    kind: Literal["group_dispatched"] = Field("group_dispatched", exclude=True)
    group_id: int
    env: str
    task_id: int
    group_size: int
    policy_version: int


class EpisodeDispatched(_Model):
    kind: Literal["episode_dispatched"] = Field("episode_dispatched", exclude=True)
    episode_id: int
    group_id: int
    attempt: int
    policy_version: int


class EpisodeCompleted(_Model):
    kind: Literal["episode_completed"] = Field("episode_completed", exclude=True)
    episode_id: int
    group_id: int
    ok: bool
    reward: float = 0.0
    token_ids: list[int] = Field(default_factory=list)
    mask: list[int] = Field(default_factory=list)
    logprobs: list[float] = Field(default_factory=list)
    policy_start: int
    policy_end: int
    temperature: float = 1.0
    error: str | None = None

    @model_validator(mode="after")
    def _aligned(self) -> EpisodeCompleted:
        if not (len(self.token_ids) == len(self.mask) == len(self.logprobs)):
            raise ValueError("token_ids, mask and logprobs must have the same length")
        return self

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def sampled_tokens(self) -> int:
        return sum(self.mask)


class EpisodeCancelled(_Model):
    kind: Literal["episode_cancelled"] = Field("episode_cancelled", exclude=True)
    episode_id: int
    reason: Literal["drain", "stop", "resume", "group_cancelled"]


class FinalizeStarted(_Model):
    kind: Literal["finalize_started"] = Field("finalize_started", exclude=True)
    group_id: int
    background: bool
    trace_ids: list[int]


class GroupFinalized(_Model):
    kind: Literal["group_finalized"] = Field("group_finalized", exclude=True)
    group_id: int
    trace_ids: list[int]
    advantages: list[float]


class FinalizeFailed(_Model):
    kind: Literal["finalize_failed"] = Field("finalize_failed", exclude=True)
    group_id: int
    error: str


class GroupSettled(_Model):
    kind: Literal["group_settled"] = Field("group_settled", exclude=True)
    group_id: int
    admitted: bool
    trace_ids: list[int]  # the traces inserted into the pending queue, in order
    dropped: dict[str, list[int]] = Field(default_factory=dict)  # reason -> completed episodes not queued


class GroupCancelled(_Model):
    kind: Literal["group_cancelled"] = Field("group_cancelled", exclude=True)
    group_id: int
    reason: Literal["stale", "overload", "drain", "stop"]
    count: int  # completed episodes of the group that will never train


class TracesDropped(_Model):
    kind: Literal["traces_dropped"] = Field("traces_dropped", exclude=True)
    trace_ids: list[int]
    reason: Literal["stale", "drain", "stop"]


class GateChanged(_Model):
    kind: Literal["gate_changed"] = Field("gate_changed", exclude=True)
    open: bool
    reason: str


class VersionPublished(_Model):
    kind: Literal["version_published"] = Field("version_published", exclude=True)
    version: int
    # The trainer's figures for the step that made this version (rundir.TRAINER_METRICS), as it
    # reported them; None before a trainer reported any (and in older logs). No rule reads them.
    metrics: dict[str, int | float] | None = None


class BatchShipped(_Model):
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

    kind: Literal["eval_episode_cancelled"] = Field("eval_episode_cancelled", exclude=True)
    episode_id: int
    reason: Literal["stop", "resume"]


class EvalCompleted(_Model):
    """Decision: an eval's result, from the samples taken by its pinned version (`scored`).
    pass@1 is the success rate; pass@k (k = samples_per_task) the share of tasks with a success
    among their scored samples; both None for an env without a success notion. `off_version`
    samples were taken by another version: counted, never mixed into the figures."""

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
    kind: Literal["drain_started"] = Field("drain_started", exclude=True)
    reason: str


class StopRequested(_Model):
    kind: Literal["stop_requested"] = Field("stop_requested", exclude=True)
    reason: str


class RunStopped(_Model):
    kind: Literal["run_stopped"] = Field("run_stopped", exclude=True)
    reason: str
    error: bool = False


Event = Annotated[
    Union[
        RunStarted, RunResumed, GroupDispatched, EpisodeDispatched, EpisodeCompleted,
        EpisodeCancelled, FinalizeStarted, GroupFinalized, FinalizeFailed, GroupSettled,
        GroupCancelled, TracesDropped, GateChanged, VersionPublished, BatchShipped,
        DrainStarted, StopRequested, RunStopped, EvalStarted, EvalEpisodeDispatched, EvalEpisodeCompleted,
        EvalEpisodeCancelled, EvalCompleted,
    ],
    Field(discriminator="kind"),
]
EVENT_ADAPTER: TypeAdapter[Event] = TypeAdapter(Event)
EVENT_TYPES: dict[str, type[_Model]] = {
    cls.model_fields["kind"].default: cls for cls in Event.__origin__.__args__  # type: ignore[attr-defined]
}
# Facts from the outside world; everything else is decided by the core.
INPUT_KINDS = frozenset(
    {"run_started", "run_resumed", "episode_completed", "group_finalized", "finalize_failed",
     "version_published", "stop_requested", "eval_episode_completed"}
)

_NESTED_KINDS = frozenset({"run_started"})
# An event's fields are its __dict__, `kind` first, in declaration order, so its data is the
# orjson encoding of that dict minus the `{"kind":"...",` head: byte for byte what pydantic's
# serializer writes (a property test checks it), at about half the cost. What orjson refuses
# goes through pydantic, which encodes big ints and names an unset field.
_KIND_HEAD_LENGTH = {kind: len(orjson.dumps({"kind": kind})) for kind in EVENT_TYPES}


def encode_event(event: _Model) -> tuple[str, bytes]:
    """(kind, data JSON) as stored in the log: the fields without `kind`."""
    kind = event.kind
    if kind not in _NESTED_KINDS:
        try:
            return kind, b"{" + orjson.dumps(event.__dict__)[_KIND_HEAD_LENGTH[kind]:]
        except orjson.JSONEncodeError:  # an int beyond 64 bits, or a field left unset
            pass
    return kind, event.__pydantic_serializer__.to_json(event)  # type: ignore[attr-defined]


def decode_event(kind: str, data: bytes | str) -> _Model:
    """The event model for a log row; raises ValueError on an unknown kind or bad data."""
    try:
        cls = EVENT_TYPES[kind]
    except KeyError:
        raise ValueError(f"unknown event kind {kind!r}") from None
    return cls.model_validate_json(data)


_new = object.__new__
# Setters of the four slots every pydantic model instance has, taken from their descriptors:
# half the cost of object.__setattr__, which looks each one up by name (5% of the core's time).
_set_dict, _set_fields_set, _set_extra, _set_private = (
    vars(BaseModel)[slot].__set__
    for slot in ("__dict__", "__pydantic_fields_set__", "__pydantic_extra__", "__pydantic_private__")
)


def decode_trusted(kind: str, data: bytes | str) -> _Model:
    """Like `decode_event`, without re-validating: for rows this code wrote itself (every field
    present, already validated at append time), where a fold must be fast. About twice as fast.
    Events with nested models still go through validation."""
    cls = EVENT_TYPES.get(kind)
    if cls is None:
        raise ValueError(f"unknown event kind {kind!r}")
    if kind in _NESTED_KINDS:
        return cls.model_validate_json(data)
    return _construct(cls, {"kind": kind, **orjson.loads(data)})


def _construct(cls: type[_Model], fields: dict) -> _Model:
    """The event `cls(**fields)` without validation: every field present (`kind` included), of
    its type, in declaration order. Its `model_fields_set` is one set of all the class's fields,
    shared by the class's events: pydantic adds to the set of a frozen model only on a copy
    (`model_copy`), and not building one per event is 3.5% of the core's time."""
    event = _new(cls)  # the same four slots as `_trusted_constructor`'s generated code sets
    _set_dict(event, fields)
    _set_fields_set(event, _ALL_FIELDS[cls])
    _set_extra(event, None)
    _set_private(event, None)
    return event


def _trusted_constructor(cls: type[_Model]) -> Callable[..., _Model]:
    """`cls(**fields)` without validation, generated for `cls` (as dataclasses generates
    `__init__`): keyword-only parameters in declaration order, each with its field's plain
    default; a field with a default factory must be given. For values valid by construction:
    the core's decisions, built from validated inputs and its own counters (validation was ~15%
    of the core's time), and the fake env's episodes. Tests check that these events equal their
    validated copies, encoded bytes included. Spelled out, it costs about half of building a
    dict of defaults and merging the keywords into it."""
    kind = cls.model_fields["kind"].default
    names = [name for name in cls.model_fields if name != "kind"]
    defaults = {}
    params = []
    for name in names:
        info = cls.model_fields[name]
        if info.is_required() or info.default_factory is not None:
            params.append(name)
        else:
            defaults[f"_default_{name}"] = info.default
            params.append(f"{name}=_default_{name}")
    body = ", ".join([f"'kind': {kind!r}"] + [f"{name!r}: {name}" for name in names])
    source = (
        f"def trusted(*, {', '.join(params)}):\n"
        f"    _event = _new(_cls)\n"
        f"    _set_dict(_event, {{{body}}})\n"
        f"    _set_fields_set(_event, _all_fields)\n"
        f"    _set_extra(_event, None)\n"
        f"    _set_private(_event, None)\n"
        f"    return _event\n"
    )
    # Internal names start with "_", which no pydantic field name can.
    namespace = {"_new": _new, "_set_dict": _set_dict, "_set_fields_set": _set_fields_set, "_set_extra": _set_extra,
                 "_set_private": _set_private, "_cls": cls, "_all_fields": _ALL_FIELDS[cls], **defaults}
    exec(source, namespace)  # noqa: S102 - the source is built from the class's own field names
    trusted = namespace["trusted"]
    trusted.__qualname__, trusted.__module__ = f"{cls.__name__}.trusted", __name__
    return trusted


_ALL_FIELDS = {cls: set(cls.model_fields) for cls in EVENT_TYPES.values()}  # every field's name
for _cls in EVENT_TYPES.values():
    _cls.trusted = staticmethod(_trusted_constructor(_cls))


# ---------------------------------------------------------------- fold views
# A fold (resume, replay) applies the reducer to every logged event but keeps almost none of
# them: nearly every trace ships or drops before the end of the log. So a fold reads each row as
# a msgspec Struct of just the fields the reducer reads (type-checked, unknown keys skipped
# without being built: about twice as cheap as a dict of every field, four times as cheap as a
# model), and builds the models only for the traces still held in the state at the end
# (`TraceView.model`).


class TraceView(msgspec.Struct, gc=False):
    """An `episode_completed` row in a fold: what the reducer reads, and `data`, the row itself,
    to decode the full event for the few traces still held when the fold ends. The reward,
    mask and logprobs are skipped by the decoder; `token_ids` is read only for its length."""

    episode_id: int
    group_id: int
    ok: bool
    policy_start: int
    token_ids: list[int]
    data: bytes = b""

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)

    def model(self) -> EpisodeCompleted:
        return decode_trusted("episode_completed", self.data)  # type: ignore[return-value]


_decode_trace_view = msgspec.json.Decoder(TraceView).decode


def trace_view(data: bytes) -> TraceView:
    view = _decode_trace_view(data)
    view.data = data
    return view


def _flat_view_decoder(cls: type[_Model]) -> Callable[[bytes], msgspec.Struct]:
    """A decoder of `cls`'s rows into a Struct with its fields (same types and defaults)."""
    fields = []
    for name, info in cls.model_fields.items():
        if name == "kind":
            continue
        if info.is_required():
            fields.append((name, info.annotation))
        elif info.default_factory is not None:
            fields.append((name, info.annotation, msgspec.field(default_factory=info.default_factory)))
        else:
            fields.append((name, info.annotation, info.default))
    view = msgspec.defstruct(f"{cls.__name__}View", fields, kw_only=True, gc=False, module=__name__)
    return msgspec.json.Decoder(view).decode


# kind -> how a fold reads its rows (any error is a ValueError): a `TraceView` for a trace, a
# Struct of the fields for the other flat events, the validated model for events with nested
# models.
FOLD_VIEWS: dict[str, Callable[[bytes], object]] = {
    kind: trace_view if kind == "episode_completed"
    else functools.partial(decode_trusted, kind) if kind in _NESTED_KINDS
    else _flat_view_decoder(cls)
    for kind, cls in EVENT_TYPES.items()
}
