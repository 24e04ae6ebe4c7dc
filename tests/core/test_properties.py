"""Property tests of the core: a Hypothesis state machine over random interleavings, and
determinism / inline-vs-background equivalence over many seeds."""

from __future__ import annotations

import json
import typing

import hypothesis.strategies as st
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from orchestrator.core import events as ev
from orchestrator.core.arrays import Tokens
from orchestrator.core.decide import decide, dispatch_gate
from orchestrator.core.evolve import fold
from orchestrator.core.state import State, conservation, state_bytes, state_from_bytes, state_hash
from tests.core.encoded import fold_encoded
from tests.support.params import sim_params
from tests.support.sim import SimOptions, SimWorld


def fold_rows_of(log) -> State:
    """The state `orch run --resume` rebuilds: the encoded rows folded; every trace it holds
    afterwards has its arrays."""
    state, _ = fold_encoded(None, log)
    assert state is not None
    held = list(state.traces.values()) + [s.trace for b in state.shipped_batches.values() for s in b]
    assert all(trace.tokens is None or trace.tokens.arrays() for trace in held)
    return state


class CoreMachine(RuleBasedStateMachine):
    """Drives the real decide/evolve with completions, errors, publishes, background results,
    stop requests and crash+resume (fold the log from scratch, then `run_resumed`)."""

    @initialize(
        group_size=st.integers(1, 4),
        batch_size=st.integers(1, 6),
        max_inflight=st.integers(1, 9),
        target_lag=st.integers(0, 2),
        max_off=st.integers(0, 3),
        max_steps=st.integers(2, 7),
        background=st.booleans(),
        constant=st.booleans(),
        token_batch=st.sampled_from([None, None, 12]),
        cap=st.integers(1, 3),
        capacity=st.sampled_from(["off", "staleness"]),
        evals=st.none()
        | st.builds(
            ev.EvalParams,
            envs=st.just(["a"]),
            every=st.integers(1, 3),
            num_tasks=st.integers(1, 3),
            samples_per_task=st.integers(1, 3),
            max_inflight=st.integers(1, 4),
        ),
    )
    def setup(
        self,
        group_size,
        batch_size,
        max_inflight,
        target_lag,
        max_off,
        max_steps,
        background,
        constant,
        token_batch,
        cap,
        capacity,
        evals,
    ):
        self.params = ev.CoreParams(
            env_ratios={"b": 2.0, "a": 1.0},
            group_size=group_size,
            batch_size=batch_size,
            max_inflight=max_inflight,
            target_lag=target_lag,
            max_off_policy_steps=max_off,
            max_steps=max_steps,
            finalize_in_background=background,
            constant_trainer_batch_size=constant,
            token_batch_size=token_batch,
            max_finalizing_groups=cap,
            zero_output_batches=50,
            eval=evals,
            capacity=capacity,
        )
        self.world = SimWorld(self.params, seed=0, options=SimOptions(settle="random", eval_off_version_rate=0.2))
        self.world.start()
        self.checked = 0  # log entries whose decisions were checked against validation

    @precondition(lambda self: self.world.state.inflight and not self.world.state.stopped)
    @rule(pick=st.integers(0, 10**6), ok=st.booleans(), data=st.data())
    def complete(self, pick, ok, data):
        inflight = list(self.world.state.inflight)
        episode_id = inflight[pick % len(inflight)]
        self.world.rng.seed(data.draw(st.integers(0, 10**6)))
        self.world.feed(self.world.completion(episode_id, ok=ok if not ok else None))

    @precondition(lambda self: self.world.state.evals.inflight and not self.world.state.stopped)
    @rule(pick=st.integers(0, 10**6), ok=st.booleans(), data=st.data())
    def complete_eval_episode(self, pick, ok, data):
        inflight = list(self.world.state.evals.inflight)
        self.world.rng.seed(data.draw(st.integers(0, 10**6)))
        self.world.feed(self.world.eval_completion(inflight[pick % len(inflight)], ok=ok if not ok else None))

    @precondition(lambda self: self.world.state.version < self.world.state.step - 1 and not self.world.state.stopped)
    @rule()
    def publish(self):
        self.world.feed(ev.VersionPublished(version=self.world.state.version + 1))

    @precondition(lambda self: self.world.held_results and not self.world.state.stopped)
    @rule(pick=st.integers(0, 10**6))
    def deliver_finalize_result(self, pick):
        held = self.world.held_results
        self.world.feed(held.pop(pick % len(held)))

    @precondition(lambda self: not self.world.state.stopped)
    @rule()
    def request_stop(self):
        self.world.feed(ev.StopRequested(reason="test"))

    @rule(through_snapshot=st.booleans())
    def crash_and_resume(self, through_snapshot):
        """The process dies: in-flight work and unreported results are lost; the log is not. The
        state is rebuilt by folding the log, and maybe saved and loaded as a snapshot."""
        world = self.world
        world.state = fold_rows_of(world.log)
        if through_snapshot:
            world.state = state_from_bytes(state_bytes(world.state))
        world.held_results.clear()
        world.feed(ev.RunResumed(from_seq=len(world.log), max_steps=self.params.max_steps))

    @invariant()
    def conservation_holds(self):
        holds, terms = conservation(self.world.state)
        assert holds, terms

    @invariant()
    def shipping_rules_hold(self):
        log = self.world.log
        steps = [e.step for e in log if e.kind == "batch_shipped"]
        assert steps == list(range(1, len(steps) + 1)), "steps contiguous, each shipped once"
        version = 0
        for e in log:
            if e.kind == "version_published":
                version = max(version, e.version)
            elif e.kind == "batch_shipped":
                assert version >= e.step - 1 - self.params.target_lag, "ship hold"
                assert e.off_policy_max <= self.params.max_off_policy_steps, "lag bound"

    @invariant()
    def grouped_episodes_are_what_the_groups_will_bring(self):
        s = self.world.state
        assert s.grouped_episodes == sum(g.size - g.cancelled for g in s.groups.values())

    @invariant()
    def evals_stay_apart_from_training(self):
        """Held-out tasks never reach a train group; every eval sample is pinned to its eval's
        version, and the run never stops completed while it still owes an eval."""
        pins = {}
        for e in self.world.log:
            if e.kind == "group_dispatched":
                assert e.task_id >= 0
            elif e.kind == "eval_started":
                assert all(t < 0 for t in e.task_ids)
                pins[e.eval_id] = e.version
            elif e.kind == "eval_episode_dispatched":
                assert e.policy_version == pins[e.eval_id] and e.task_id < 0
        s = self.world.state
        if s.stop_reason == "completed" and s.params.eval is not None:
            assert not s.evals.open and s.evals.last_version >= s.params.max_steps

    @invariant()
    def dispatch_gate_is_current(self):
        """Between inputs the logged gate is what its rule says: completions rely on it."""
        s = self.world.state
        assert (s.gate_open, s.gate_reason) == dispatch_gate(s)

    @invariant()
    def decisions_pass_their_type_checks(self):
        """The core builds its decisions unchecked (a Struct's constructor checks no type)."""
        log = self.world.log
        for event in log[self.checked :]:
            if event.kind not in ev.INPUT_KINDS:
                validated = ev.checked(type(event), **msgspec.structs.asdict(event))
                assert validated == event and ev.encode_event(validated) == ev.encode_event(event), event
        self.checked = len(log)

    @invariant()
    def fold_of_the_log_equals_the_live_state(self):
        live = state_hash(self.world.state)
        assert state_hash(fold(self.world.log)) == live
        assert state_hash(fold_rows_of(self.world.log)) == live


TestCoreMachine = CoreMachine.TestCase
TestCoreMachine.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def _canonical(log) -> bytes:
    return b"\n".join(
        kind.encode() + b" " + data + b" " + (payload or b"") for kind, data, payload in map(ev.encode_event, log)
    )


@pytest.mark.parametrize("seed", range(5))
def test_identical_inputs_give_byte_identical_events(seed):
    a = SimWorld(sim_params(seed, max_steps=12), seed=seed)
    b = SimWorld(sim_params(seed, max_steps=12), seed=seed)
    a.run()
    b.run()
    assert a.state.stop_reason == "completed"
    assert _canonical(a.log) == _canonical(b.log)


@pytest.mark.parametrize("seed", range(3))
def test_a_state_restored_from_its_snapshot_decides_like_the_live_one(seed):
    """The snapshot's keys are sorted; the order of env_ratios, which the env choice walks, must
    survive it (it did not: a resume from a snapshot chose other envs)."""
    world = SimWorld(sim_params(seed, max_steps=12, env_ratios={"b": 1.0, "a": 1.0, "c": 2.0}), seed=seed)
    world.start()
    restored = state_from_bytes(state_bytes(world.state))
    assert list(restored.params.env_ratios) == ["b", "a", "c"]
    feed = world.feed

    def feed_both(event):
        decisions = feed(event)
        assert [ev.encode_event(e) for e in decide(restored, event)] == [ev.encode_event(e) for e in decisions]
        return decisions

    world.feed = feed_both
    world.run()
    assert world.state.stop_reason == "completed"
    assert state_hash(restored) == state_hash(world.state)


@pytest.mark.parametrize("capacity", ["off", "staleness"])
@pytest.mark.parametrize("background", [False, True])
@pytest.mark.parametrize("target_lag", [0, 1])
def test_dispatch_gate_is_current_after_every_input(target_lag, background, capacity):
    """A completion refills its permit without re-checking the gate; that is right only if every
    other rule leaves the gate current. Checked after each input of whole simulated runs (the
    state machine above checks it too, on fewer, shorter runs)."""
    for seed in range(3):
        world = SimWorld(
            sim_params(
                seed,
                max_steps=12,
                target_lag=target_lag,
                finalize_in_background=background,
                max_finalizing_groups=2,
                capacity=capacity,
            ),
            seed=seed,
            options=SimOptions(publish_weight=0.3, settle="random"),
        )
        feed = world.feed

        def feed_and_check(event, feed=feed, world=world):
            decisions = feed(event)
            s = world.state
            assert (s.gate_open, s.gate_reason) == dispatch_gate(s), (event, decisions)
            return decisions

        world.feed = feed_and_check
        world.run()
        assert world.state.stop_reason == "completed"


@pytest.mark.parametrize("seed", range(12))
def test_not_opted_in_and_opted_in_with_immediate_settle_ship_identical_batches(seed):
    inline = SimWorld(sim_params(seed, max_steps=12), seed=seed)
    background = SimWorld(sim_params(seed, max_steps=12, finalize_in_background=True), seed=seed)
    inline.run()
    background.run()
    batches = [[e for e in w.log if e.kind == "batch_shipped"] for w in (inline, background)]
    assert len(batches[0]) == 12
    assert batches[0] == batches[1]
    assert inline.state.acct == background.state.acct


@pytest.mark.parametrize("seed", range(6))
def test_random_settle_order_keeps_totals_and_meets_stale_cancels(seed):
    opts = SimOptions(settle="random", deliver_weight=0.05)
    params = sim_params(seed, max_steps=12, finalize_in_background=True, max_off_policy_steps=0, target_lag=2)
    world = SimWorld(params, seed=seed, options=opts)
    world.run()
    assert world.state.stop_reason == "completed"
    assert conservation(world.state)[0]
    assert sum(1 for e in world.log if e.kind == "group_cancelled" and e.reason == "stale") > 0


def test_decoding_round_trips_every_kind_exactly():
    world = SimWorld(
        sim_params(3, max_steps=12, finalize_in_background=True), seed=3, options=SimOptions(settle="random")
    )
    world.run()
    kinds = set()
    for event in world.log:
        kind, data, payload = ev.encode_event(event)
        decoded = ev.decode_event(kind, data, payload)
        assert decoded == event and ev.encode_event(decoded) == (kind, data, payload)
        kinds.add(kind)
    assert len(kinds) >= 12


_FLAT_EVENT_TYPES = [cls for kind, cls in ev.EVENT_TYPES.items() if kind != "run_started"]
_FINITE = st.floats(allow_nan=False, allow_infinity=False)  # NaN and infinities have no JSON


def _values_of(annotation):
    if annotation is float:
        return _FINITE
    if annotation == float | None:
        return st.none() | _FINITE
    if annotation == list[float]:
        return st.lists(_FINITE, max_size=4)
    if annotation == list[tuple[int, float]]:  # group_finalized's sample advantages
        return st.lists(st.tuples(st.integers(), _FINITE), max_size=3)
    if annotation == dict[str, int | float] | None:  # version_published's trainer metrics
        return st.none() | st.dictionaries(st.text(max_size=8), st.integers() | _FINITE, max_size=3)
    return st.from_type(annotation)


@settings(max_examples=400, deadline=None)
@given(data=st.data(), cls=st.sampled_from(_FLAT_EVENT_TYPES))
def test_every_event_round_trips_its_row_for_any_field_values(data, cls):
    """An event's row decodes to the same event and encodes to the same bytes, for every value a
    field can hold (unicode and control characters, extreme floats, big ints); a field at its
    default is not written."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: _values_of(hints[f.name]) for f in msgspec.structs.fields(cls)}
    if cls is ev.EpisodeCompleted:  # its arrays are aligned, its runs and samples fit them
        n = data.draw(st.integers(0, 4))
        fields.update(
            tokens=st.builds(
                Tokens.of,
                st.lists(st.integers(-(2**31), 2**31 - 1), min_size=n, max_size=n),
                st.lists(st.integers(0, 1), min_size=n, max_size=n),
                st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False), min_size=n, max_size=n),
            ),
            token_versions=st.just(()),  # runs must fit the mask: test_token_versions.py
            samples=st.just(()),  # samples must fit the arrays: tests/core/test_samples.py
            agents=st.just(()),
            agent_rewards=st.just(()),
        )
    event = data.draw(st.builds(cls, **fields))
    kind, encoded, payload = ev.encode_event(event)
    assert (payload is None) == (cls is not ev.EpisodeCompleted or event.n_tokens == 0)
    decoded = ev.decode_event(kind, encoded, payload)
    assert decoded == event and ev.encode_event(decoded) == (kind, encoded, payload)
    written = json.loads(encoded)
    for f in msgspec.structs.fields(cls):
        if f.required:
            assert f.name in written, f.name
        else:
            default = f.default_factory() if f.default is msgspec.NODEFAULT else f.default
            assert (f.name in written) == (getattr(event, f.name) != default), f.name


@pytest.mark.parametrize("cls", list(ev.EVENT_TYPES.values()), ids=list(ev.EVENT_TYPES))
def test_a_default_is_one_that_equal_events_write_alike(cls):
    """A field at its default is not written, and msgspec recognises a default by identity for a
    scalar: so defaults are singletons (None, False, small ints) or empty collections, never a
    float (an equal float computed elsewhere is another object, and would be written)."""
    for f in msgspec.structs.fields(cls):
        if f.required or (cls is ev.RunStarted):
            continue
        default = f.default_factory() if f.default is msgspec.NODEFAULT else f.default
        assert default in (None, False, 0, (), [], {}) and type(default) is not float, f.name
