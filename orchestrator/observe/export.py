"""`orch export RUN OUT.db`: a run's log as flat analysis tables, written with sqlite-utils.

Tables (a row per item, typed columns, indexed, full-text search on error messages; open the
file as is in Datasette or any SQLite tool; example queries in docs/observe.md):

* `episodes`: every dispatched episode attempt: its group, env and task, attempt, dispatch
  version, and once completed its reward, ok/error, prompt and completion tokens, policy
  start/end, advantage, `text` (the completion decoded with the run's tokenizer; NULL with
  `--no-text`); its `fate` at the end of the log and the `reason`:
  shipped (with `step` and `lag`, its off-policy lag in that batch), dropped (reason: stale,
  failed, no_output, rejected, zero_advantage, drain, stop, overload), cancelled (reason: drain,
  stop, resume, group_cancelled; a completion that came after it is counted in `late`), or still
  held: pending (queued) or in_group, or in_flight;
* `groups`: every dispatched group: env, task, size, dispatch version, finalize path and error,
  its `outcome` (admitted, rejected, no_output, cancelled with its reason) and counts;
* `batches`: every shipped batch: samples, pruned, tokens, mean reward, off-policy lag, the
  version published when it shipped, sha256;
* `versions`: every published version with the trainer's metrics (one column each).

The hot path (the run's own appends) stays on the stdlib driver; this reads the log once.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from eventlog import CorruptLogError, EventLog, PayloadDroppedError
from orchestrator.core.arrays import PayloadError
from orchestrator.core.events import decode_event
from orchestrator.core.evolve import evolve_from
from orchestrator.core.state import State
from orchestrator.fold import payload_reader_around_damage
from orchestrator.observe.rows import fold_events

if TYPE_CHECKING:
    from orchestrator.observe.text import Decoder

EPISODE_COLUMNS = {
    "id": int,
    "group_id": int,
    "env": str,
    "task_id": int,
    "attempt": int,
    "dispatch_version": int,
    "ok": int,
    "reward": float,
    "error": str,
    "prompt_tokens": int,
    "completion_tokens": int,
    "policy_start": int,
    "policy_end": int,
    "advantage": float,
    "fate": str,
    "reason": str,
    "step": int,
    "lag": int,
    "late": int,
    "text": str,
    "completed_seq": int,
    "completed_ts": float,
}
GROUP_COLUMNS = {
    "id": int,
    "env": str,
    "task_id": int,
    "group_size": int,
    "policy_version": int,
    "background": int,
    "outcome": str,
    "reason": str,
    "queued": int,
    "dropped": int,
    "finalize_error": str,
    "dispatched_seq": int,
    "dispatched_ts": float,
}
BATCH_COLUMNS = {
    "step": int,
    "seq": int,
    "ts": float,
    "samples": int,
    "pruned": int,
    "tokens": int,
    "reward_mean": float,
    "off_policy_max": int,
    "off_policy_mean": float,
    "version": int,
    "sha256": str,
}
VERSION_COLUMNS = {"version": int, "seq": int, "ts": float}


class Export:
    """The tables, built from a run's events in log order (`take`)."""

    def __init__(self) -> None:
        self.state: State | None = None  # the reducer's own, for the members a group cancel drops
        self.episodes: dict[int, dict] = {}
        self.groups: dict[int, dict] = {}
        self.batches: list[dict] = []
        self.versions: dict[int, dict] = {}
        self.seq = 0

    def take(self, ts: float, e) -> None:
        self.seq += 1
        try:
            getattr(self, "_" + e.kind, _ignore)(ts, e)  # reads the state before `e`
        except KeyError:
            # An id the tables lack, in an event that the reducer refuses too (InconsistentEvent:
            # damage); the tables take every event the reducer takes, so if it takes this one,
            # the tables have a bug.
            evolve_from(self.state, e)
            raise
        self.state = evolve_from(self.state, e)

    def _group_dispatched(self, ts: float, e) -> None:
        self.groups[e.group_id] = {
            "id": e.group_id,
            "env": e.env,
            "task_id": e.task_id,
            "group_size": e.group_size,
            "policy_version": e.policy_version,
            "background": 0,
            "outcome": "open",
            "queued": 0,
            "dropped": 0,
            "dispatched_seq": self.seq,
            "dispatched_ts": ts,
        }

    def _episode_dispatched(self, ts: float, e) -> None:
        group = self.groups[e.group_id]
        self.episodes[e.episode_id] = {
            "id": e.episode_id,
            "group_id": e.group_id,
            "env": group["env"],
            "task_id": group["task_id"],
            "attempt": e.attempt,
            "dispatch_version": e.policy_version,
            "fate": "in_flight",
            "late": 0,
        }

    def _episode_completed(self, ts: float, e) -> None:
        if e.episode_id not in self.state.inflight:  # cancelled before it finished: the reducer ignores it
            if (episode := self.episodes.get(e.episode_id)) is not None:
                episode["late"] = 1
            return
        episode = self.episodes[e.episode_id]
        episode.update(
            ok=int(e.ok),
            reward=e.reward,
            error=e.error,
            prompt_tokens=e.n_tokens - e.sampled_tokens,
            completion_tokens=e.sampled_tokens,
            policy_start=e.policy_start,
            policy_end=e.policy_end,
            fate="in_group",
            completed_seq=self.seq,
            completed_ts=ts,
        )

    def _episode_cancelled(self, ts: float, e) -> None:
        self.episodes[e.episode_id].update(fate="cancelled", reason=e.reason)

    def _finalize_started(self, ts: float, e) -> None:
        self.groups[e.group_id]["background"] = int(e.background)

    def _group_finalized(self, ts: float, e) -> None:
        for episode_id, advantage in zip(e.episode_ids, e.advantages):
            if (episode := self.episodes.get(episode_id)) is not None:  # the reducer ignores an unknown group's
                episode["advantage"] = advantage

    _background_finalized = _group_finalized  # the same scores, sent by a background finalize

    def _finalize_failed(self, ts: float, e) -> None:
        if (group := self.groups.get(e.group_id)) is not None:  # the reducer ignores an unknown group's
            group["finalize_error"] = e.error

    def _group_settled(self, ts: float, e) -> None:
        group = self.groups[e.group_id]
        finalizing = self.state.groups[e.group_id].finalizing
        group["outcome"] = "admitted" if e.admitted else "rejected" if finalizing else "no_output"
        group["queued"] = len(e.sample_ids)
        for sample_id in e.sample_ids:
            self.episodes[sample_id]["fate"] = "pending"
        for reason, trace_ids in e.dropped.items():
            self._drop(trace_ids, reason)

    def _group_cancelled(self, ts: float, e) -> None:
        self.groups[e.group_id].update(outcome="cancelled", reason=e.reason)
        self._drop(list(self.state.groups[e.group_id].members), e.reason)

    def _traces_dropped(self, ts: float, e) -> None:
        self._drop(e.trace_ids, e.reason)

    def _drop(self, trace_ids, reason: str) -> None:
        for trace_id in trace_ids:
            episode = self.episodes[trace_id]
            episode.update(fate="dropped", reason=reason)
            self.groups[episode["group_id"]]["dropped"] += 1

    def _batch_shipped(self, ts: float, e) -> None:
        for sample_id in e.sample_ids:
            episode = self.episodes[sample_id]
            episode.update(fate="shipped", step=e.step, lag=(e.step - 1) - episode["policy_start"])
        self._drop(e.pruned_ids, "zero_advantage")
        self.batches.append(
            {
                "step": e.step,
                "seq": self.seq,
                "ts": ts,
                "samples": len(e.sample_ids),
                "pruned": len(e.pruned_ids),
                "tokens": e.n_tokens,
                "reward_mean": e.reward_mean,
                "off_policy_max": e.off_policy_max,
                "off_policy_mean": e.off_policy_mean,
                "version": self.state.version,
                "sha256": e.sha256,
            }
        )

    def _version_published(self, ts: float, e) -> None:
        self.versions[e.version] = {"version": e.version, "seq": self.seq, "ts": ts, **(e.metrics or {})}


def _ignore(ts: float, e) -> None:
    """Events with nothing for the tables (gate changes, drain, stop, start and resume markers)."""


def metric_types(versions) -> dict[str, type]:
    """A column per trainer metric: INTEGER if every version reported it as an int, else REAL."""
    types: dict[str, type] = {}
    for version in versions:
        for name, value in version.items():
            if name not in VERSION_COLUMNS:
                types[name] = int if type(value) is int and types.get(name, int) is int else float
    return types


TEXT_CHUNK = 512  # episodes whose token arrays are read at once


def add_texts(log: EventLog, episodes: dict[int, dict], decoder: Decoder) -> dict[int, str]:
    """Each completed episode's `text`: the tokens it sampled, decoded (its token arrays are read
    only now: the fold reads the traces' scalars alone). A payload that is damaged (fails its
    checksum, its side file missing), dropped (log.token_arrays) or does not decode leaves its
    text NULL: returned, seq -> the one line that says why."""
    by_seq = {e["completed_seq"]: e for e in episodes.values() if e.get("completion_tokens") and "completed_seq" in e}
    rows = [(seq, data) for seq, _ts, _kind, data in log.read_raw(kinds=("episode_completed",)) if seq in by_seq]
    unreadable: dict[int, str] = {}
    read_payloads = payload_reader_around_damage(log, unreadable, (CorruptLogError, PayloadDroppedError))
    for start in range(0, len(rows), TEXT_CHUNK):
        chunk = rows[start : start + TEXT_CHUNK]
        payloads = read_payloads([seq for seq, _data in chunk])
        for seq, data in chunk:
            if seq in unreadable:
                continue
            try:
                event = decode_event("episode_completed", data, payloads.get(seq))
            except PayloadError as err:  # a log without checksums: damage shows only here
                unreadable[seq] = f"seq {seq}: {err}"
                continue
            by_seq[seq]["text"] = decoder.completion_text(event.token_ids, event.mask)
    return unreadable


def export_run(log: EventLog, out: Path, decoder: Decoder | None = None, note=lambda line: None) -> dict[str, int]:
    """Write `log`'s tables into a new SQLite file `out` (built aside, then renamed into place, so a
    failed export leaves nothing), each completed episode's completion decoded into `text` with
    `decoder` (None: NULL; a damaged payload's: NULL, said through `note`); return the row count
    of each table."""
    import sqlite_utils

    export = Export()
    for _ in fold_events(log, export.take):
        pass
    if decoder is not None and (unreadable := add_texts(log, export.episodes, decoder)):
        first = unreadable[min(unreadable)]
        why = "their payloads are damaged or dropped"
        note(f"{len(unreadable)} episodes' text is left NULL: {why} (the first: {first})")
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    tmp.unlink(missing_ok=True)
    try:
        db = sqlite_utils.Database(tmp)
        metric_columns = metric_types(export.versions.values())
        tables = (
            ("episodes", export.episodes.values(), "id", EPISODE_COLUMNS),
            ("groups", export.groups.values(), "id", GROUP_COLUMNS),
            ("batches", export.batches, "step", BATCH_COLUMNS),
            ("versions", export.versions.values(), "version", {**VERSION_COLUMNS, **metric_columns}),
        )
        for name, records, pk, columns in tables:
            db[name].create(columns, pk=pk)
            db[name].insert_all(records, pk=pk, columns=columns, batch_size=1000)
        for columns in (["group_id"], ["fate", "reason"], ["env"], ["step"]):
            db["episodes"].create_index(columns)
        db["groups"].create_index(["outcome"])
        db["episodes"].enable_fts(["error"], create_triggers=True)
        db["groups"].enable_fts(["finalize_error"], create_triggers=True)
        counts = {name: db[name].count for name, *_ in tables}
        db.close()
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return counts
