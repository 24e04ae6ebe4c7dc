"""`orch replay --diff A B`: a normalized, streaming comparison of two runs' logs.

Both logs are read in lockstep, chunk by chunk (`EventLog.read_raw`), so memory stays flat
whatever their length: nothing is collected but the current chunk of each log (and, at the
accounting level, the two folded states, whose size does not grow with the log).

Levels (what "equivalent" means):

* ``batches``    the `batch_shipped` decisions, field by field: step, trace ids in batch order, the
                 sha256 of the batch payload (token ids, masks, logprobs, advantages,
                 temperatures, lag stamps), pruned ids, token count, lag and reward figures.
* ``accounting`` the sequences of episodes admitted (queued by `group_settled`), cancelled
                 (`episode_cancelled`, `group_cancelled`) and sampled (shipped), then the
                 accounting totals of the folded end states.
* ``curriculum`` the order of (env, task_id) over the `group_dispatched` decisions.
* ``evals``      the eval results (`eval_completed`), field by field: env, pinned version, figures.
* ``events``     every event, inputs and decisions, in order; a trace's token arrays too, or where
                 either run dropped them (`log.token_arrays`), their sha256 (`payload_sha256`).

Timestamps (the `ts` column) are never compared; fields that hold durations or positions in the
log (`MASKED_FIELDS`) are masked. The first divergence is reported Temporal-replayer style: the
seq in each run, both events, and a structural diff of the fields that differ.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from itertools import islice, zip_longest
from typing import Any

import orjson

from eventlog import DroppedPayload, EventLog
from orchestrator.core.arrays import PayloadError, unpack
from orchestrator.core.events import logged_n_tokens
from replay.source import ReplayInputError, guarded, row_data

LEVELS = ("batches", "accounting", "curriculum", "evals", "events")
# Never compared: wall-clock durations (none are logged today; listed so a future one is masked),
# positions in a particular log (`run_resumed.from_seq` names a seq of *that* log), and the
# trainer's measurements (`version_published.metrics`: step times, losses of nondeterministic
# kernels), which no rule reads.
MASKED_FIELDS = frozenset({"ts", "duration_s", "elapsed_s", "wall_s", "latency_s", "from_seq", "metrics"})
MAX_FIELD_DIFFS = 25
_MISSING = "<missing>"


@dataclass
class Side:
    seq: int
    kind: str
    data: Any

    def to_dict(self) -> dict:
        return {"seq": self.seq, "kind": self.kind, "data": self.data}


@dataclass
class FieldDiff:
    path: str
    a: Any
    b: Any

    def to_dict(self) -> dict:
        return {"path": self.path, "a": self.a, "b": self.b}


@dataclass
class Divergence:
    what: str  # e.g. "batch #3", "event #120", "admitted[57]", "totals"
    index: int  # position in the compared stream (0-based); -1 for end-of-run totals
    a: Side | None  # None: run A has no such item (it ended first)
    b: Side | None
    fields: list[FieldDiff] = field(default_factory=list)
    more_fields: int = 0  # differing fields beyond MAX_FIELD_DIFFS
    note: str = ""

    def to_dict(self) -> dict:
        return {
            "what": self.what,
            "index": self.index,
            "note": self.note,
            "a": self.a.to_dict() if self.a else None,
            "b": self.b.to_dict() if self.b else None,
            "fields": [f.to_dict() for f in self.fields],
            "more_fields": self.more_fields,
        }


@dataclass
class DiffResult:
    level: str
    a: str
    b: str
    equivalent: bool
    compared: int  # items compared (batches, events, dispatches, accounting items)
    divergence: Divergence | None = None
    details: dict = field(default_factory=dict)  # level-specific extras (accounting: totals, sets)

    def to_dict(self) -> dict:
        return {
            "level": self.level,
            "a": self.a,
            "b": self.b,
            "equivalent": self.equivalent,
            "compared": self.compared,
            "divergence": self.divergence.to_dict() if self.divergence else None,
            "details": self.details,
        }


# --- normalization and structural diff ----------------------------------------------------------


def normalize(data: Any) -> Any:
    """The data with MASKED_FIELDS removed at every depth."""
    if isinstance(data, dict):
        return {k: normalize(v) for k, v in data.items() if k not in MASKED_FIELDS}
    if isinstance(data, list):
        return [normalize(v) for v in data]
    return data


def _same_scalar(a: Any, b: Any) -> bool:
    return a == b and (type(a) is bool) == (type(b) is bool)


def structural_diff(a: Any, b: Any, limit: int = MAX_FIELD_DIFFS) -> tuple[list[FieldDiff], int]:
    """Leaf-level differences between two JSON values: ([FieldDiff(path, a, b)], how many more)."""
    out: list[FieldDiff] = []
    more = 0

    def add(path: str, x: Any, y: Any) -> None:
        nonlocal more
        if len(out) < limit:
            out.append(FieldDiff(path or ".", x, y))
        else:
            more += 1

    def walk(x: Any, y: Any, path: str) -> None:
        if isinstance(x, dict) and isinstance(y, dict):
            for k in sorted(x.keys() | y.keys()):
                sub = f"{path}.{k}" if path else k
                if k not in x:
                    add(sub, _MISSING, y[k])
                elif k not in y:
                    add(sub, x[k], _MISSING)
                else:
                    walk(x[k], y[k], sub)
        elif isinstance(x, list) and isinstance(y, list):
            for i, (u, v) in enumerate(zip(x, y)):
                walk(u, v, f"{path}[{i}]")
            if len(x) != len(y):
                add(f"{path}.length", len(x), len(y))
        elif not _same_scalar(x, y):
            add(path, x, y)

    walk(a, b, "")
    return out, more


def divergence_of(
    what: str, index: int, a: Side | None, b: Side | None, project: Callable[[Side], Any] | None = None, note: str = ""
) -> Divergence:
    if a is not None and b is not None:
        pa = project(a) if project else {"kind": a.kind, **a.data}
        pb = project(b) if project else {"kind": b.kind, **b.data}
        fields, more = structural_diff(pa, pb)
    else:
        fields, more = [], 0
    return Divergence(what, index, a, b, fields, more, note)


# --- streaming ------------------------------------------------------------------------------------


def _rows(log: EventLog, kinds: tuple[str, ...] | None = None, chunk_size: int = 4096) -> Iterator[tuple]:
    """(seq, ts, kind, data, payload) rows: a trace's token arrays are compared too, or where
    either run dropped them (log.token_arrays), their sha256 (a DroppedPayload)."""
    return guarded(log.read_rows(kinds=kinds, chunk_size=chunk_size, dropped_as_sha256=True), log.path)


def _comparable(x: tuple, y: tuple) -> tuple[tuple, tuple]:
    """Two rows as compared: where one run dropped a payload the other kept, the kept one is
    compared by its sha256, as the dropped one can only be."""
    px, py = x[4], y[4]
    if isinstance(px, DroppedPayload) and isinstance(py, bytes):
        return x, (*y[:4], DroppedPayload(hashlib.sha256(py).hexdigest()))
    if isinstance(py, DroppedPayload) and isinstance(px, bytes):
        return (*x[:4], DroppedPayload(hashlib.sha256(px).hexdigest())), y
    return x, y


def _side(row: tuple, source: str) -> Side:
    """A row as compared: its data, and for a trace its arrays as lists (decoded only for a row
    whose bytes differ, so a divergence names the first tokens that differ), or the sha256 of a
    dropped payload (`payload_sha256`)."""
    seq, _ts, kind, data, payload = row
    fields = row_data(seq, data, source)
    if isinstance(payload, DroppedPayload) and isinstance(fields, dict):
        fields["payload_sha256"] = payload.sha256
    elif payload is not None and (n_tokens := logged_n_tokens(fields)) is not None:
        try:
            token_ids, mask, logprobs = unpack(payload, n_tokens)
        except PayloadError as err:
            raise ReplayInputError(f"{source}: seq {seq}: {err}") from None
        fields.update(token_ids=token_ids.tolist(), mask=list(mask), logprobs=logprobs.tolist())
    return Side(seq, kind, normalize(fields))


def _compare_rows(
    a_log: EventLog,
    b_log: EventLog,
    kinds: tuple[str, ...] | None,
    what: Callable[[int, Side], str],
    key: Callable[[Side], Any] | None = None,
    chunk: int = 4096,
) -> tuple[int, Divergence | None]:
    """Lockstep over the two logs' rows (of `kinds`, or all), a bounded chunk of each at a time;
    (items compared, first divergence or None). Equal chunks (same kinds, same data bytes; ts
    ignored) are skipped whole."""
    ra, rb = _rows(a_log, kinds, chunk), _rows(b_log, kinds, chunk)
    index = 0
    while True:
        ca, cb = list(islice(ra, chunk)), list(islice(rb, chunk))
        if not ca and not cb:
            return index, None
        if len(ca) == len(cb) and [r[2:] for r in ca] == [r[2:] for r in cb]:
            index += len(ca)
            continue
        for x, y in zip_longest(ca, cb):
            if x is not None and y is not None:
                x, y = _comparable(x, y)
                if x[2:] == y[2:]:
                    index += 1
                    continue  # same kind, same bytes (data and token payload): equal
                a, b = _side(x, a_log.path), _side(y, b_log.path)
                if key is not None:
                    if key(a) == key(b):
                        index += 1
                        continue
                elif a.kind == b.kind and not structural_diff(a.data, b.data, limit=1)[0]:
                    index += 1
                    continue  # equal once masked fields are gone
                return index, divergence_of(what(index, a), index, a, b, key)
            only_a = _side(x, a_log.path) if x is not None else None
            only_b = _side(y, b_log.path) if y is not None else None
            present = only_a or only_b
            assert present is not None, "zip_longest pads one side only"
            note = f"run {'A' if only_a is None else 'B'} has no {what(index, present)}: it ended first"
            return index, divergence_of(what(index, present), index, only_a, only_b, note=note)


def _batch_what(i: int, s: Side) -> str:
    return f"batch #{i + 1} (step {s.data.get('step')})"


def diff_batches(a: EventLog, b: EventLog) -> DiffResult:
    n, div = _compare_rows(a, b, ("batch_shipped",), _batch_what)
    return DiffResult("batches", a.path, b.path, div is None, n, div)


def _curriculum_key(s: Side) -> dict:
    return {"env": s.data.get("env"), "task_id": s.data.get("task_id")}


def diff_curriculum(a: EventLog, b: EventLog) -> DiffResult:
    n, div = _compare_rows(a, b, ("group_dispatched",), lambda i, s: f"group dispatch #{i + 1}", key=_curriculum_key)
    return DiffResult("curriculum", a.path, b.path, div is None, n, div)


def diff_evals(a: EventLog, b: EventLog) -> DiffResult:
    n, div = _compare_rows(
        a, b, ("eval_completed",), lambda i, s: f"eval result #{i + 1} ({s.data.get('env')} v{s.data.get('version')})"
    )
    return DiffResult("evals", a.path, b.path, div is None, n, div)


def diff_events(a: EventLog, b: EventLog, chunk_size: int = 256) -> DiffResult:
    # Chunks of a few hundred rows: a long-context trace's payload is 8 bytes per token.
    n, div = _compare_rows(a, b, None, lambda i, s: f"event #{i + 1}", chunk=chunk_size)
    return DiffResult("events", a.path, b.path, div is None, n, div)


# --- accounting -------------------------------------------------------------------------------


def _admitted(side: Side) -> Iterator[Any]:
    yield from side.data.get("sample_ids", ())


def _cancelled(side: Side) -> Iterator[Any]:
    d = side.data
    if side.kind == "episode_cancelled":
        yield ["episode", d.get("episode_id"), d.get("reason")]
    else:
        yield ["group", d.get("group_id"), d.get("reason"), d.get("count")]


def _sampled(side: Side) -> Iterator[Any]:
    yield from side.data.get("sample_ids", ())


ACCOUNTING_SEQUENCES: dict[str, tuple[tuple[str, ...], Callable[[Side], Iterator[Any]]]] = {
    "admitted": (("group_settled",), _admitted),
    "cancelled": (("episode_cancelled", "group_cancelled"), _cancelled),
    "sampled": (("batch_shipped",), _sampled),
}
_MASK64 = (1 << 64) - 1


def _items(log: EventLog, kinds: tuple[str, ...], explode) -> Iterator[tuple[Side, Any]]:
    for row in _rows(log, kinds):
        side = _side(row, log.path)
        for item in explode(side):
            yield side, item


def _set_hash(item: Any) -> int:
    # Order-independent multiset fingerprint: sum of per-item hashes (stable within a process).
    return hash(orjson.dumps(item)) & _MASK64


def _compare_sequence(name: str, a: EventLog, b: EventLog) -> dict:
    """Stream one accounting sequence of both runs: first differing element and set equality."""
    kinds, explode = ACCOUNTING_SEQUENCES[name]
    count_a = count_b = sum_a = sum_b = 0
    first: Divergence | None = None
    for index, (x, y) in enumerate(zip_longest(_items(a, kinds, explode), _items(b, kinds, explode))):
        if x is not None:
            count_a += 1
            sum_a = (sum_a + _set_hash(x[1])) & _MASK64
        if y is not None:
            count_b += 1
            sum_b = (sum_b + _set_hash(y[1])) & _MASK64
        if first is None and (x is None or y is None or x[1] != y[1]):
            what = f"{name}[{index}]"
            if x is None or y is None:
                note = f"run {'A' if x is None else 'B'} has no {what}: its {name} sequence ended first"
            else:
                note = f"{name}[{index}]: A={x[1]!r} B={y[1]!r}"
            first = divergence_of(what, index, x[0] if x else None, y[0] if y else None, note=note)
    return {
        "first": first,
        "report": {
            "count_a": count_a,
            "count_b": count_b,
            "same_sequence": first is None,
            "same_set": count_a == count_b and sum_a == sum_b,
        },
    }


def _totals(log: EventLog) -> dict:
    from orchestrator.core.state import conservation
    from replay.summary import _acct, fold_run

    state = fold_run(log).state
    assert state is not None, "fold_run gives a state"
    holds, terms = conservation(state)
    return {
        "acct": _acct(state),
        "conservation": holds,
        "step": state.step,
        "version": state.version,
        "stop_reason": state.stop_reason,
    }


def diff_accounting(a: EventLog, b: EventLog) -> DiffResult:
    sequences, firsts = {}, []
    compared = 0
    for name in ACCOUNTING_SEQUENCES:
        out = _compare_sequence(name, a, b)
        sequences[name] = out["report"]
        compared += max(out["report"]["count_a"], out["report"]["count_b"])
        if out["first"] is not None:
            firsts.append(out["first"])
    ta, tb = _totals(a), _totals(b)
    details = {"sequences": sequences, "totals": {"a": ta, "b": tb, "equal": ta["acct"] == tb["acct"]}}
    div = None
    if firsts:  # the earliest in the logs (by seq in A, then in B; a missing side counts as the end)
        inf = float("inf")
        div = min(firsts, key=lambda d: (d.a.seq if d.a else inf, d.b.seq if d.b else inf))
    elif ta["acct"] != tb["acct"]:
        fields, more = structural_diff(ta["acct"], tb["acct"])
        div = Divergence(
            "totals",
            -1,
            Side(a.last_seq, "end", ta["acct"]),
            Side(b.last_seq, "end", tb["acct"]),
            fields,
            more,
            "the accounting totals of the end states differ",
        )
    return DiffResult("accounting", a.path, b.path, div is None, compared, div, details)


DIFFERS = {
    "batches": diff_batches,
    "accounting": diff_accounting,
    "curriculum": diff_curriculum,
    "evals": diff_evals,
    "events": diff_events,
}


def diff_logs(a: EventLog, b: EventLog, level: str = "batches") -> DiffResult:
    try:
        differ = DIFFERS[level]
    except KeyError:
        raise ReplayInputError(f"unknown diff level {level!r}; choose one of {', '.join(LEVELS)}") from None
    return differ(a, b)


# --- rendering --------------------------------------------------------------------------------


def _abbrev(value: Any, max_list: int = 12) -> Any:
    if isinstance(value, dict):
        return {k: _abbrev(v, max_list) for k, v in value.items()}
    if isinstance(value, list):
        if len(value) > max_list:
            return [_abbrev(v, max_list) for v in value[: max_list // 2]] + [f"… (+{len(value) - max_list // 2})"]
        return [_abbrev(v, max_list) for v in value]
    return value


def _pretty(side: Side | None) -> str:
    if side is None:
        return "(none: the run ended)"
    body = orjson.dumps(_abbrev(side.data), option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS).decode()
    return f"{side.kind}\n{body}"


def render_divergence(div: Divergence, console, a_label: str = "A", b_label: str = "B") -> None:
    from rich.table import Table

    console.print(f"first divergence: {div.what}" + (f" — {div.note}" if div.note else ""))
    side = Table(show_lines=True)
    side.add_column("")
    side.add_column(f"{a_label}", overflow="fold")
    side.add_column(f"{b_label}", overflow="fold")
    side.add_row("seq", str(div.a.seq) if div.a else "-", str(div.b.seq) if div.b else "-")
    side.add_row("event", _pretty(div.a), _pretty(div.b))
    console.print(side)
    if div.fields:
        t = Table(title="differing fields", title_justify="left")
        t.add_column("field")
        t.add_column(a_label, overflow="fold")
        t.add_column(b_label, overflow="fold")
        for f in div.fields:
            t.add_row(f.path, repr(_abbrev(f.a)), repr(_abbrev(f.b)))
        if div.more_fields:
            t.add_row(f"… {div.more_fields} more", "", "")
        console.print(t)


def render_result(result: DiffResult, console) -> None:
    unit = {
        "batches": "batches",
        "accounting": "accounting items",
        "curriculum": "group dispatches",
        "evals": "eval results",
        "events": "events",
    }[result.level]
    if result.equivalent:
        console.print(f"equivalent at the {result.level} level: {result.compared} {unit} compared")
    else:
        before = "" if result.level == "accounting" else f" ({result.compared} {unit} identical before it)"
        console.print(f"DIVERGENT at the {result.level} level{before}")
    if result.level == "accounting":
        from rich.table import Table

        t = Table(title="accounting sequences", title_justify="left")
        for col in ("sequence", "A", "B", "same sequence", "same set"):
            t.add_column(col)
        for name, r in result.details["sequences"].items():
            t.add_row(name, str(r["count_a"]), str(r["count_b"]), str(r["same_sequence"]), str(r["same_set"]))
        console.print(t)
        totals = result.details["totals"]
        if not totals["equal"]:
            fields, _ = structural_diff(totals["a"]["acct"], totals["b"]["acct"], limit=100)
            console.print("totals differ: " + ", ".join(f"{f.path} {f.a}→{f.b}" for f in fields))
        else:
            console.print("totals equal")
    if result.divergence is not None:
        render_divergence(result.divergence, console, f"A {result.a}", f"B {result.b}")
