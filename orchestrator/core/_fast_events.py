"""The speed devices of the event catalogue: constructors that skip validation, and fold views.

They are justified by two benchmarks, and only by them: `bench/test_core_bench.py::
test_core_decide_evolve_throughput` (the core builds every decision with `Event.unvalidated`)
and `bench/test_resume_bench.py` (a resume or replay folds every logged row through `FOLD_VIEWS`).
The tests in tests/core/test_properties.py check that what they build equals the validated
models, encoded bytes included. Imported by `orchestrator.core` itself, so every event class has
its `unvalidated` constructor whatever module is imported first.
"""

from __future__ import annotations

import functools
from array import array
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import msgspec
import orjson
from pydantic import BaseModel

from orchestrator.core.events import _NESTED_KINDS, EVENT_TYPES, EpisodeCompleted, _Model, episode_from_fields
from orchestrator.core.samples import SampleHead, sample_heads, sample_of_head, split_episode

if TYPE_CHECKING:
    from orchestrator.core.state import Trace

_new = object.__new__
# Setters of the four slots every pydantic model instance has, taken from their descriptors:
# cheaper than object.__setattr__, which looks each one up by name on every call.
_set_dict, _set_fields_set, _set_extra, _set_private = (
    vars(BaseModel)[slot].__set__
    for slot in ("__dict__", "__pydantic_fields_set__", "__pydantic_extra__", "__pydantic_private__")
)


def decode_unvalidated(kind: str, data: bytes | str, payload: bytes | None = None) -> _Model:
    """Like `decode_event`, without re-validating: for rows this code wrote itself (every field
    present, already validated at append time), where a fold must be fast.
    Events with nested models still go through validation."""
    cls = EVENT_TYPES.get(kind)
    if cls is None:
        raise ValueError(f"unknown event kind {kind!r}")
    if kind in _NESTED_KINDS:
        return cls.model_validate_json(data)
    if kind == "episode_completed":
        return episode_from_fields(orjson.loads(data), payload, validate=False)
    return _construct(cls, {"kind": kind, **orjson.loads(data)})


def _construct(cls: type[_Model], fields: dict[str, Any]) -> _Model:
    """The event `cls(**fields)` without validation: every field present (`kind` included), of
    its type, in declaration order. Its `model_fields_set` is one set of all the class's fields,
    shared by the class's events: pydantic adds to the set of a frozen model only on a copy
    (`model_copy`), so one set per class is enough."""
    event = _new(cls)  # the same four slots as `unvalidated_constructor`'s generated code sets
    _set_dict(event, fields)
    _set_fields_set(event, _ALL_FIELDS[cls])
    _set_extra(event, None)
    _set_private(event, None)
    return event


def unvalidated_constructor(cls: type[_Model]) -> Callable[..., _Model]:
    """`cls(**fields)` without validation, generated for `cls` (as dataclasses generates
    `__init__`): keyword-only parameters in declaration order, each with its field's plain
    default; a field with a default factory must be given. For values valid by construction:
    the core's decisions, built from validated inputs and its own counters (validating them
    was a large share of the core's time), and the fake env's episodes. Tests check that these events equal their
    validated copies, encoded bytes included. Spelled out, it is cheaper than building a dict of
    defaults and merging the keywords into it."""
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
        f"def unvalidated(*, {', '.join(params)}):\n"
        f"    _event = _new(_cls)\n"
        f"    _set_dict(_event, {{{body}}})\n"
        f"    _set_fields_set(_event, _all_fields)\n"
        f"    _set_extra(_event, None)\n"
        f"    _set_private(_event, None)\n"
        f"    return _event\n"
    )
    # Internal names start with "_", which no pydantic field name can.
    namespace = {
        "_new": _new,
        "_set_dict": _set_dict,
        "_set_fields_set": _set_fields_set,
        "_set_extra": _set_extra,
        "_set_private": _set_private,
        "_cls": cls,
        "_all_fields": _ALL_FIELDS[cls],
        **defaults,
    }
    exec(source, namespace)  # noqa: S102 - the source is built from the class's own field names
    unvalidated = namespace["unvalidated"]
    unvalidated.__qualname__, unvalidated.__module__ = f"{cls.__name__}.unvalidated", __name__
    return unvalidated


_ALL_FIELDS = {cls: set(cls.model_fields) for cls in EVENT_TYPES.values()}  # every field's name
for _cls in EVENT_TYPES.values():
    _cls.unvalidated = staticmethod(unvalidated_constructor(_cls))


# ---------------------------------------------------------------- fold views
# A fold (resume, replay) applies the reducer to every logged event but keeps almost none of
# them: nearly every trace ships or drops before the end of the log. So a fold reads each row as
# a msgspec Struct of just the fields the reducer reads (type-checked, unknown keys skipped
# without being built: cheaper than a dict of every field, much cheaper than a model), and builds
# the models only for the traces still held in the state at the end
# (`TraceView.model`).


class TraceView(msgspec.Struct, gc=False):
    """An `episode_completed` row in a fold: its scalars, what the reducer reads, and `data`, the
    row itself, to decode the full event for the few traces still held when the fold ends, with
    its payload (`payload`, read by `seq` once the fold knows which traces it holds)."""

    kind: ClassVar[str] = "episode_completed"
    episode_id: int
    group_id: int
    ok: bool
    reward: float
    n_tokens: int
    sampled_tokens: int
    policy_start: int
    policy_end: int
    temperature: float
    error: str | None
    token_versions: tuple[tuple[int, int], ...] = ()
    samples: tuple[tuple[int, int], ...] = ()
    agents: tuple[str, ...] = ()
    agent_rewards: tuple[tuple[str, float], ...] = ()
    data: bytes = b""
    seq: int = 0
    payload: bytes | None = None

    def model(self) -> EpisodeCompleted:
        return decode_unvalidated("episode_completed", self.data, self.payload)  # type: ignore[return-value]

    # The arrays of a `Trace`, for a reader inside a fold (the fold itself never reads them):
    # from the full event, once its payload is read.
    @property
    def token_ids(self) -> array:
        return self.model().token_ids

    @property
    def mask(self) -> bytes:
        return self.model().mask

    @property
    def logprobs(self) -> array:
        return self.model().logprobs


class SampleView:
    """One sample of a several-sample `TraceView` that a fold split when its group settled: its
    scalars (`samples.SampleHead`), and its arrays from the episode's, read only if it is still
    held when the fold ends (its payload is the episode's: `seq` and `payload` are the parent's)."""

    __slots__ = ("parent", "head")
    kind: ClassVar[str] = "episode_completed"
    ok: ClassVar[bool] = True
    error: ClassVar[None] = None
    samples: ClassVar[tuple] = ()
    agent_rewards: ClassVar[tuple] = ()

    def __init__(self, parent: TraceView, head: SampleHead):
        self.parent, self.head = parent, head

    episode_id = property(lambda self: self.head.trace_id)
    group_id = property(lambda self: self.parent.group_id)
    reward = property(lambda self: self.head.reward)
    n_tokens = property(lambda self: self.head.n_tokens)
    sampled_tokens = property(lambda self: self.head.sampled_tokens)
    policy_start = property(lambda self: self.head.policy_start)
    policy_end = property(lambda self: self.head.policy_end)
    temperature = property(lambda self: self.parent.temperature)
    token_versions = property(lambda self: self.head.token_versions)
    agents = property(lambda self: (self.head.agent,) if self.head.agent is not None else ())
    seq = property(lambda self: self.parent.seq)

    @property
    def payload(self) -> bytes | None:
        return self.parent.payload

    @payload.setter
    def payload(self, payload: bytes | None) -> None:
        self.parent.payload = payload

    def model(self) -> EpisodeCompleted:
        return sample_of_head(self.parent.model(), self.head)

    # The arrays from its model, as a trace view's.
    token_ids, mask, logprobs = TraceView.token_ids, TraceView.mask, TraceView.logprobs


def split_trace(trace: Trace) -> Sequence[Trace]:
    """A trace's samples as traces of their own, in a live run (`samples.split_episode`) or in a
    fold (`SampleView`s of its view)."""
    if not trace.samples:
        return [trace]
    if isinstance(trace, TraceView):
        return [SampleView(trace, head) for head in sample_heads(trace)]
    return split_episode(trace)  # type: ignore[arg-type]  # an EpisodeCompleted


if TYPE_CHECKING:
    _A_TRACE_VIEW_IS_A_TRACE: type[Trace] = TraceView
    _A_SAMPLE_VIEW_IS_A_TRACE: type[Trace] = SampleView


_decode_trace_view = msgspec.json.Decoder(TraceView).decode


def trace_view(data: bytes) -> TraceView:
    view = _decode_trace_view(data)
    view.data = data
    return view


def _flat_view_decoder(cls: type[_Model]) -> Callable[[bytes], msgspec.Struct]:
    """A decoder of `cls`'s rows into a Struct with its fields (same types and defaults)."""
    fields: list[tuple[Any, ...]] = []
    for name, info in cls.model_fields.items():
        if name == "kind":
            continue
        if info.is_required():
            fields.append((name, info.annotation))
        elif info.default_factory is not None:
            factory = functools.partial(info.get_default, call_default_factory=True)
            fields.append((name, info.annotation, msgspec.field(default_factory=factory)))
        else:
            fields.append((name, info.annotation, info.default))
    view = msgspec.defstruct(f"{cls.__name__}View", fields, kw_only=True, gc=False, module=__name__)
    return msgspec.json.Decoder(view).decode


# kind -> how a fold reads its rows (any error is a ValueError): a `TraceView` for a trace, a
# Struct of the fields for the other flat events, the validated model for events with nested
# models.
FOLD_VIEWS: dict[str, Callable[[bytes], object]] = {
    kind: trace_view
    if kind == "episode_completed"
    else functools.partial(decode_unvalidated, kind)
    if kind in _NESTED_KINDS
    else _flat_view_decoder(cls)
    for kind, cls in EVENT_TYPES.items()
}
