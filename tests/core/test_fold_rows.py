"""`fold_rows`: the fold that resume and replay run over logged rows (views, not models)."""

from __future__ import annotations

import msgspec
import pytest

from orchestrator.core import events as ev
from orchestrator.core import evolve as evolve_module
from orchestrator.core.evolve import FoldError, fold, fold_rows
from orchestrator.core.state import initial_state, state_hash
from tests.core.encoded import encoded_rows, fold_encoded
from tests.support.sim import SimOptions, SimWorld


@pytest.fixture(scope="module")
def sim_log():
    params = ev.CoreParams(
        env_ratios={"a": 1.0, "b": 1.0},
        group_size=4,
        batch_size=8,
        max_inflight=12,
        max_steps=30,
        max_off_policy_steps=1,
        token_batch_size=None,
        finalize_in_background=True,
        zero_output_batches=1000,
    )
    world = SimWorld(params, seed=5, options=SimOptions(publish_weight=0.3, settle="random"))
    world.run()
    return world.log


@pytest.mark.parametrize("cut", [0.25, 0.5, 0.8, 1.0])
def test_fold_rows_equals_the_fold_of_the_models_and_holds_only_models(sim_log, cut):
    events = sim_log[: int(len(sim_log) * cut)]
    state, count = fold_encoded(None, events)
    assert count == len(events)
    assert state_hash(state) == state_hash(fold(events))
    held = list(state.traces.values()) + [s.trace for b in state.shipped_batches.values() for s in b]
    assert all(type(trace) is ev.EpisodeCompleted for trace in held)
    assert held or cut == 1.0  # mid-run, traces are held (a finished run holds none)


def test_fold_rows_continues_a_state_from_any_point(sim_log):
    half = len(sim_log) // 2
    state, _ = fold_encoded(None, sim_log[:half])
    state, count = fold_encoded(state, sim_log[half:], first_seq=half + 1)
    assert count == len(sim_log) - half
    assert state_hash(state) == state_hash(fold(sim_log))


def test_a_fold_from_nothing_starts_with_run_started(sim_log):
    assert fold_rows(None, []) == (None, 0)
    with pytest.raises(
        FoldError, match="seq 1: cannot fold the 'gate_changed' event: a run's first event is run_started"
    ):
        fold_encoded(None, sim_log[1:])
    assert fold(sim_log[:1]).params == sim_log[0].params


@pytest.mark.parametrize(
    "row, error",
    [
        (("no_such_kind", b"{}"), "seq 12: cannot fold the 'no_such_kind' event: ValueError: unknown event kind"),
        (
            ("episode_dispatched", b"{not json"),
            "seq 12: cannot fold the 'episode_dispatched' event: DecodeError: JSON is malformed",
        ),
        (
            ("episode_dispatched", b'{"episode_id":1}'),
            "seq 12: cannot fold the 'episode_dispatched' event: ValidationError: "
            "Object missing required field `group_id`",
        ),
        (
            (
                "episode_completed",
                b'{"episode_id":"1","group_id":1,"ok":true,"reward":0.0,"tokens":[0,0],'
                b'"policy_start":0,"policy_end":0,"temperature":1.0}',
            ),
            "seq 12: cannot fold the 'episode_completed' event: ValidationError: "
            "Expected `int`, got `str` - at `$.episode_id`",
        ),
        (
            ("episode_dispatched", b'{"episode_id":1,"group_id":999,"attempt":0,"policy_version":0}'),
            "seq 12: cannot fold the 'episode_dispatched' event: group 999 is not in the state",
        ),
        (
            ("episode_cancelled", b'{"episode_id":999,"reason":"stop"}'),
            "seq 12: cannot fold the 'episode_cancelled' event: in-flight episode 999 is not in the state",
        ),
        (
            ("traces_dropped", b'{"trace_ids":[999],"reason":"stale"}'),
            "seq 12: cannot fold the 'traces_dropped' event: held trace 999 is not in the state",
        ),
    ],
)
def test_a_row_that_cannot_be_folded_names_its_seq(sim_log, row, error):
    rows = encoded_rows(sim_log[:2])[0] + [row]
    with pytest.raises(FoldError) as info:
        fold_rows(None, rows, first_seq=10)
    assert str(info.value).startswith(error) and info.value.seq == 12


def test_a_log_of_another_format_version_is_refused_naming_it(sim_log):
    """Version 5 wrote a trace's sizes as fields of their own: its rows are not read as version 6."""
    rows, _ = encoded_rows([msgspec.structs.replace(sim_log[0], schema_version=5)])
    with pytest.raises(
        FoldError,
        match=r"seq 1: cannot fold the 'run_started' event: an orch log of "
        r"format version 5; this orch reads version 6 only",
    ):
        fold_rows(None, rows)


@pytest.mark.parametrize("bug", [KeyError(7), AttributeError("'Group' object has no attribute 'x'"), AssertionError()])
def test_a_reducer_bug_is_raised_as_itself_not_as_log_damage(sim_log, monkeypatch, bug):
    """Only what damage causes reads as "cannot fold": a reducer that fails on a sound log raises
    its own exception, with the reducer in its traceback."""

    def broken_reducer(state, event):
        raise bug

    monkeypatch.setitem(evolve_module._REDUCERS, "gate_changed", broken_reducer)
    rows, payloads = encoded_rows(sim_log)
    with pytest.raises(type(bug)) as info:
        fold_rows(None, rows, 1, payloads)
    assert not isinstance(info.value, FoldError)
    assert info.traceback[-1].name == "broken_reducer"


def test_decide_hands_out_the_batch_file_its_sha256_covers(sim_log):
    """The shell writes the bytes `decide` hashed (no second encoding); rebuilding them from the
    state, as a resume does, gives the same bytes."""
    from orchestrator.core.batch import batch_sha256
    from orchestrator.core.decide import decide
    from orchestrator.shell.loop import Orchestrator

    state, payloads, shipped = initial_state(sim_log[0].params), {}, []
    for event in (e for e in sim_log if e.kind in ev.INPUT_KINDS):
        for decision in decide(state, event, payloads):
            if decision.kind == "batch_shipped":
                shipped.append(decision)
                rebuilt = Orchestrator.batch_payload(decision.step, state.shipped_batches[decision.step])
                assert payloads[decision.step] == rebuilt
    assert len(shipped) == 30 and sorted(payloads) == list(range(1, 31))
    assert all(batch_sha256(payloads[e.step]) == e.sha256 for e in shipped)
