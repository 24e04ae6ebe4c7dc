"""`orch replay RUN [--at SEQ]`: the folded state as a stable summary (dict) and as rich tables."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from eventlog import EventLog, LogError
from orchestrator.core.state import State, conservation, min_fresh_version, state_hash
from orchestrator.figures import eval_result_dict
from orchestrator.fold import Folded, FoldError, fold_log
from replay.source import REEXECUTED_META, ReplayInputError, one_line, row_data

if TYPE_CHECKING:
    from rich.console import JustifyMethod


def fold_run(log: EventLog, at: int | None = None) -> Folded:
    """fold_log with input checks and errors mapped to ReplayInputError."""
    try:
        last = log.last_seq
        if at is not None and not 1 <= at <= last:  # before seq 1 there is no run yet
            raise ReplayInputError(f"--at {at} is outside the log (seq 1..{last})")
        folded = fold_log(log, at=at)
    except LogError as err:
        raise ReplayInputError(one_line(str(err))) from None
    except FoldError as err:  # an event the reducer cannot take
        raise ReplayInputError(one_line(f"{log.path}: {err}")) from None
    if folded.state is None:
        raise ReplayInputError(f"{log.path} holds no event yet: no run to summarize")
    return folded


def summarize(folded: Folded, log: EventLog) -> dict[str, Any]:
    """Everything `orch replay RUN` shows; JSON-ready, deterministic for a given log and seq."""
    s = folded.state
    assert s is not None, "fold_run gives a state"
    holds, terms = conservation(s)
    meta = log.meta
    groups_open, groups_finalizing = [], []
    for g in s.groups.values():
        if g.finalizing:
            groups_finalizing.append(
                {
                    "group_id": g.group_id,
                    "env": g.env,
                    "task_id": g.task_id,
                    "background": g.background,
                    "survivors": list(g.survivors),
                    "scored": bool(g.advantages),
                    "error": s.finalize_errors.get(g.group_id),
                }
            )
        else:
            groups_open.append(
                {
                    "group_id": g.group_id,
                    "env": g.env,
                    "task_id": g.task_id,
                    "size": g.size,
                    "policy_version": g.policy_version,
                    "members": list(g.members),
                    "inflight": list(g.inflight),
                    "cancelled": g.cancelled,
                }
            )
    pending = [
        {
            "sample_id": q.sample_id,
            "group_id": q.group_id,
            "env": q.env,
            "dispatch_version": q.dispatch_version,
            "policy_start": q.policy_start,
            "n_tokens": q.n_tokens,
            "advantage": q.advantage,
        }
        for q in s.pending.values()
    ]
    p = s.params
    return {
        "log": str(log.path),
        "seq": folded.seq,
        "last_seq": log.last_seq,
        "from_snapshot": folded.from_snapshot,
        "events_folded": folded.events_folded,
        "reexecuted": meta.get(REEXECUTED_META),
        "params": p.model_dump(),
        "step": s.step,
        "version": s.version,
        "min_fresh_version": min_fresh_version(p, s.step),
        "gate": {"open": s.gate_open, "reason": s.gate_reason},
        "draining": s.draining,
        "stopped": s.stopped,
        "stop_reason": s.stop_reason,
        "inflight_episodes": len(s.inflight),
        "pending": {"samples": len(pending), "tokens": s.pending_tokens, "items": pending},
        "open_groups": groups_open,
        "finalizing_groups": groups_finalizing,
        "finalizing_per_env": dict(s.finalizing),
        "shipped_untrained_steps": list(s.shipped_batches),
        "accounting": _acct(s),
        "evals": _evals(s),
        "trainer_metrics": trainer_metrics(log, folded.seq),
        "faults": faults(log, folded.seq),
        "conservation": {"holds": holds, **terms},
        "state_hash": state_hash(s),
    }


def _evals(s: State) -> dict[str, Any] | None:
    """Eval results per version, the evals still open, and the evals' own accounting (None: the
    run has no evals)."""
    if s.params.eval is None:
        return None
    e = s.evals
    return {
        "results": [eval_result_dict(r) for r in e.results],
        "open": [
            {
                "eval_id": x.eval_id,
                "env": x.env,
                "version": x.version,
                "samples": x.size,
                "scored": len(x.scored),
                "failures": x.failures,
                "off_version": x.off_version,
                "inflight": len(x.inflight),
            }
            for x in e.open.values()
        ],
        "accounting": {name: getattr(e.acct, name) for name in type(e.acct).__slots__},
    }


def trainer_metrics(log: EventLog, at: int) -> dict[int, dict[str, float]]:
    """version -> the figures the trainer reported with it (`version_published.metrics`), up to
    seq `at`; versions published without any are left out."""
    out = {}
    try:
        for seq, _ts, _kind, data in log.read_raw(1, at, kinds=("version_published",)):
            event = row_data(seq, data, str(log.path))
            if isinstance(event, dict) and isinstance(event.get("metrics"), dict):
                out[event["version"]] = event["metrics"]
    except LogError as err:
        raise ReplayInputError(one_line(str(err))) from None
    return out


FAULT_KINDS = ("trainer_restarted", "endpoint_changed")


def faults(log: EventLog, at: int) -> list[dict[str, Any]]:
    """The trainer's restarts and the launched servers' downs and ups, up to seq `at`, in order:
    {seq, kind, and the event's fields}."""
    try:
        return [
            {"seq": seq, "kind": kind, **row_data(seq, data, str(log.path))}
            for seq, _ts, kind, data in log.read_raw(1, at, kinds=FAULT_KINDS)
        ]
    except LogError as err:
        raise ReplayInputError(one_line(str(err))) from None


def _fault_row(fault: dict[str, Any]) -> tuple[str, str, str]:
    if fault["kind"] == "trainer_restarted":
        return str(fault["seq"]), f"trainer restarted ({fault['attempt']})", fault["cause"]
    what = f"server {fault['url']} " + ("up" if fault["up"] else "down")
    return str(fault["seq"]), what, fault["cause"]


TRAINER_METRICS_SHOWN = 10  # the table shows the newest versions; --json has them all


def _acct(s: State) -> dict[str, Any]:
    a = s.acct
    return {
        name: (dict(getattr(a, name)) if isinstance(getattr(a, name), dict) else getattr(a, name))
        for name in type(a).__slots__
    }


def _print_items(
    console, title: str, columns: tuple[str, ...], rows: list[tuple[str, ...]], justify: JustifyMethod = "left"
) -> None:
    """A titled table of items, printed only when there are any."""
    from rich.table import Table

    if not rows:
        return
    table = Table(title=title, title_justify="left")
    for column in columns:
        table.add_column(column, justify=justify)
    for row in rows:
        table.add_row(*row)
    console.print(table)


def _figure(value) -> str:
    if value is None:
        return ""
    return str(value) if isinstance(value, int) else f"{value:.4g}"


def _columns_that_fit(names: list[str], rows: dict[int, dict[str, str]], width: int) -> list[list[str]]:
    """The metric names in runs of columns, each run a table no wider than the terminal (a
    table wider than it has its values cut to "0.1…"); at least one column a table."""
    version_width = max([len("version"), *(len(str(v)) for v in rows)]) + 4  # padding, both borders
    parts: list[list[str]] = [[]]
    used = version_width
    for name in names:
        column = max([len(name), *(len(row[name]) for row in rows.values())]) + 3  # padding, border
        if parts[-1] and used + column > width:
            parts.append([])
            used = version_width
        parts[-1].append(name)
        used += column
    return parts if names else []


def _ids(ids: list[int], limit: int = 12) -> str:
    text = ", ".join(map(str, ids[:limit]))
    return text + (f", … (+{len(ids) - limit})" if len(ids) > limit else "")


def render(summary: dict[str, Any], console) -> None:
    """Human view of `summarize()` (rich tables)."""
    from rich.table import Table

    head = Table(
        title=f"orch replay {summary['log']} @ seq {summary['seq']}/{summary['last_seq']}",
        show_header=False,
        title_justify="left",
    )
    head.add_column("field", style="bold")
    head.add_column("value")
    folded = f"{summary['events_folded']} events"
    if summary["from_snapshot"] is not None:
        folded += f" after the snapshot at seq {summary['from_snapshot']}"
    rows = [
        ("folded", folded),
        ("step (next batch)", str(summary["step"])),
        ("version", str(summary["version"])),
        ("min fresh version", str(summary["min_fresh_version"])),
        ("gate", f"{'open' if summary['gate']['open'] else 'closed'} ({summary['gate']['reason']})"),
        (
            "status",
            "stopped: " + str(summary["stop_reason"])
            if summary["stopped"]
            else ("draining" if summary["draining"] else "running"),
        ),
        ("in-flight episodes", str(summary["inflight_episodes"])),
        ("pending", f"{summary['pending']['samples']} samples, {summary['pending']['tokens']} tokens"),
        ("open groups", str(len(summary["open_groups"]))),
        ("finalizing groups", str(len(summary["finalizing_groups"]))),
    ]
    if summary["reexecuted"]:
        rows.append(("re-executed", summary["reexecuted"]))
    cons = summary["conservation"]
    rows.append(
        (
            "conservation",
            ("holds" if cons["holds"] else "VIOLATED")
            + ": completed {completed} = shipped "
            "{shipped} + pending {pending} + in groups {in_groups} + dropped {dropped}".format(**cons),
        )
    )
    rows.append(("state hash", summary["state_hash"]))
    for k, v in rows:
        head.add_row(k, v)
    console.print(head)
    _print_items(console, "faults", ("seq", "what", "cause"), [_fault_row(f) for f in summary["faults"]])

    _print_items(
        console,
        "pending samples (queue order)",
        ("sample", "group", "env", "dispatch v", "policy start", "tokens", "advantage"),
        [
            (
                str(q["sample_id"]),
                str(q["group_id"]),
                q["env"],
                str(q["dispatch_version"]),
                str(q["policy_start"]),
                str(q["n_tokens"]),
                f"{q['advantage']:+.4f}",
            )
            for q in summary["pending"]["items"]
        ],
        justify="right",
    )
    _print_items(
        console,
        "open groups",
        ("group", "env", "task", "v", "members", "in flight", "cancelled"),
        [
            (
                str(g["group_id"]),
                g["env"],
                str(g["task_id"]),
                str(g["policy_version"]),
                _ids(g["members"]),
                _ids(g["inflight"]),
                str(g["cancelled"]),
            )
            for g in summary["open_groups"]
        ],
    )
    _print_items(
        console,
        "finalizing groups",
        ("group", "env", "task", "background", "survivors", "scored", "error"),
        [
            (
                str(g["group_id"]),
                g["env"],
                str(g["task_id"]),
                str(g["background"]),
                _ids(g["survivors"]),
                str(g["scored"]),
                g["error"] or "",
            )
            for g in summary["finalizing_groups"]
        ],
    )
    evals = summary.get("evals")
    if evals is not None:
        _print_items(
            console,
            "evals (per version)",
            ("env", "version", "reward", "pass@1", "pass@k", "scored", "tokens"),
            [
                (
                    r["env"],
                    str(r["version"]),
                    _figure(r["reward_mean"]),
                    _figure(r["pass_at_1"]),
                    _figure(r["pass_at_k"]) + f" (k={r['k']})",
                    str(r["scored"]),
                    str(r["tokens"]),
                )
                for r in evals["results"]
            ],
            justify="right",
        )
        _print_items(
            console,
            "evals open",
            ("eval", "env", "version", "samples", "scored", "failures", "off version", "in flight"),
            [
                tuple(
                    str(x[k])
                    for k in ("eval_id", "env", "version", "samples", "scored", "failures", "off_version", "inflight")
                )
                for x in evals["open"]
            ],
        )
    metrics = summary["trainer_metrics"]
    names = list(dict.fromkeys(name for figures in metrics.values() for name in figures))
    shown = sorted(metrics)[-TRAINER_METRICS_SHOWN:]
    title = (
        f"trainer metrics (the newest {len(shown)} of {len(metrics)} versions)"
        if len(shown) < len(metrics)
        else "trainer metrics"
    )
    figures = {v: {name: _figure(metrics[v].get(name)) for name in names} for v in shown}
    for part in _columns_that_fit(names, figures, console.width):
        metric_rows: list[tuple[str, ...]] = [(str(v), *(figures[v][n] for n in part)) for v in shown]
        _print_items(console, title, ("version", *part), metric_rows, justify="right")
        title = f"{title.split(' (')[0]} (continued)"
    t = Table(title="accounting", title_justify="left", show_header=False)
    t.add_column("total", style="bold")
    t.add_column("value", justify="right")
    for k, v in summary["accounting"].items():
        t.add_row(k, ", ".join(f"{r}={n}" for r, n in sorted(v.items())) or "0" if isinstance(v, dict) else str(v))
    console.print(t)
