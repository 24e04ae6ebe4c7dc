"""`orch replay RUN --check`: re-derive every decision of a log from its recorded inputs.

The recorded inputs are handed, in order, to the *current* `decide`, starting from the initial
state; each decision it returns must equal the recorded decision at that position, byte for byte
(the log's JSON). The first event the current code would decide differently (or not at all, or
in addition) is reported. While decisions match, `decide`'s state is exactly the fold of the log,
so every later input is checked against the right state.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import orjson

from eventlog import DamagedSnapshotsError, EventLog, LogError
from orchestrator.core import events as ev
from orchestrator.core.decide import decide
from orchestrator.core.events import EVENT_TYPES, INPUT_KINDS, encode_event
from orchestrator.core.state import State, initial_state
from replay.damage import payload_damage
from replay.diff import Divergence, Side, divergence_of
from replay.inputs import decode
from replay.source import ReplayInputError, guarded, one_line, row_data


@dataclass
class CheckResult:
    path: str
    deterministic: bool
    inputs: int  # recorded inputs re-decided
    decisions: int  # recorded decisions re-derived identically
    divergence: Divergence | None = None
    damage: str | None = None  # the divergence is the log's damage (replay.damage), named here

    def to_dict(self) -> dict:
        return {
            "log": self.path,
            "deterministic": self.deterministic,
            "inputs": self.inputs,
            "decisions": self.decisions,
            "divergence": self.divergence.to_dict() if self.divergence else None,
            "damage": self.damage,
        }


def _side_of_row(row: tuple) -> Side:
    seq, _ts, kind, data, _payload = row
    return Side(seq, kind, row_data(seq, data))


def _side_of_event(seq: int, event) -> Side:
    kind, data, _payload = encode_event(event)
    return Side(seq, kind, orjson.loads(data))


def _diverged(what: str, recorded: Side | None, derived: Side | None, note: str) -> Divergence:
    at = recorded or derived
    assert at is not None, "a divergence has a recorded or a derived event"
    return divergence_of(what, at.seq, recorded, derived, note=note)


def _state_for(first: ev.Event) -> State:
    """The state a run starts from: the one its first input, `run_started`, makes."""
    if not isinstance(first, ev.RunStarted):
        raise ValueError(f"{first.kind!r} before run_started")
    return initial_state(first.params)


def check_log(log: EventLog) -> CheckResult:
    """The check of `log`; ReplayInputError if the file is damaged (a damaged b-tree can hide the
    rows after it from a read: what is left would check as deterministic)."""
    try:
        log.check_damage()
    except DamagedSnapshotsError:
        pass  # snapshots are caches: the check folds from the first event
    except LogError as err:
        raise ReplayInputError(one_line(str(err))) from None
    result = _check(log)
    recorded = result.divergence.a if result.divergence is not None else None
    if recorded is not None and recorded.kind == "batch_shipped" and isinstance(recorded.data, dict):
        result.damage = payload_damage(log, recorded.seq, recorded.data)
    return result


def _check(log: EventLog) -> CheckResult:
    state: State | None = None
    expected: deque = deque()  # decisions the current code made for the last input, not yet matched
    input_seq = 0
    inputs = decisions = 0

    def diverged(where: str, recorded: Side | None, current: Side | None, why: str) -> CheckResult:
        return CheckResult(log.path, False, inputs, decisions, _diverged(where, recorded, current, why))

    seq = 0
    for row in guarded(log.read_rows(), log.path):
        seq, _ts, kind, data, payload = row
        if kind in INPUT_KINDS:
            if expected:
                return diverged(
                    f"decision #{decisions + 1}",
                    _side_of_row(row),
                    _side_of_event(seq, expected[0]),
                    f"for the input at seq {input_seq} the current code decides more than was recorded; "
                    f"the recording moves on to the next input at seq {seq}",
                )
            event = decode(row, log.path)
            try:
                state = state or _state_for(event)
                out = decide(state, event)
            except Exception as err:  # a recorded input the current code cannot take
                return diverged(
                    f"input at seq {seq}",
                    _side_of_row(row),
                    None,
                    f"the current code raises on this recorded input: {type(err).__name__}: {err}",
                )
            expected = deque(out)
            input_seq = seq
            inputs += 1
            continue
        if kind not in EVENT_TYPES:
            decode(row, log.path)  # raises ReplayInputError: not an event this code knows
        if not expected:
            return diverged(
                f"decision #{decisions + 1}",
                _side_of_row(row),
                None,
                f"recorded decision that the current code does not make for the input at seq {input_seq}",
            )
        derived = expected.popleft()
        dkind, ddata, dpayload = encode_event(derived)
        if dkind == kind and ddata == data and dpayload == payload:
            decisions += 1
            continue
        recorded_side, derived_side = _side_of_row(row), Side(seq, dkind, orjson.loads(ddata))
        if recorded_side.kind == dkind and recorded_side.data == derived_side.data:
            decisions += 1  # same values, different JSON spelling
            continue
        return diverged(
            f"decision #{decisions + 1}",
            recorded_side,
            derived_side,
            f"the current code decides this differently for the input at seq {input_seq}",
        )
    if expected:
        return diverged(
            f"decision #{decisions + 1}",
            None,
            _side_of_event(seq + 1, expected[0]),
            f"the log ends, but the current code decides more for the input at seq {input_seq}",
        )
    return CheckResult(log.path, True, inputs, decisions)
