"""A run's per-step figures, from its log's events: the one source of what the metric sinks show
and `orch plot` draws.

`StepRows.feed(ts, event)` folds one logged event (the reducer's own `evolve`, so buffered and
finalizing mean what they mean in the run) and returns the rows it completes, each
`(step, name, value)`:

* at `batch_shipped` N: the batch (`reward/mean`, `lag/max`, `lag/mean`, `batch/samples`,
  `batch/tokens`), the queue right after it (`queue/buffered`: completed episodes waiting to
  train, queued or held by finalizing groups; `queue/finalizing`: groups finalizing in the
  background; `version`), the waste so far (`waste/dropped`: completed episodes that will never
  train, for any reason but the run's end, `core.state.wasted_samples`; `waste/pct`: that share
  of the completions), and the throughput over the
  last THROUGHPUT_WINDOW ships (`throughput/episodes_per_s`, `throughput/tokens_per_s`:
  completions logged and their sampled tokens since the ship that many steps back, or since the
  run (re)started, over the `ts` gap; over one ship it would read zero whenever two batches ship
  in one commit);
* at `version_published` N with metrics: `trainer/NAME` for each figure the trainer reported;
* at `eval_completed` for version N (docs/evals.md): `eval/ENV/reward_mean`, `eval/ENV/pass_at_1`
  and `eval/ENV/pass_at_k`, those the env has.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

from eventlog import EventLog
from orchestrator.core import events as ev
from orchestrator.core.evolve import DECODE_ERRORS, FoldError, InconsistentEvent, evolve_from
from orchestrator.core.state import State, wasted_samples

Row = tuple[int, str, float]
TRAINER_PREFIX = "trainer/"
EVAL_PREFIX = "eval/"
EVAL_FIGURES = ("reward_mean", "pass_at_1", "pass_at_k")
T = TypeVar("T")
THROUGHPUT_WINDOW = 5


def buffered_episodes(state: State) -> int:
    """Completed episodes waiting to train: queued, or held by groups still finalizing."""
    return len(state.pending) + sum(len(g.members) for g in state.groups.values() if g.finalizing)


class StepRows:
    """Fold a run's events in log order (`feed`), returning the rows each one completes."""

    def __init__(self) -> None:
        self.state: State | None = None
        self._episodes = 0  # completions logged since the run (re)started
        self._tokens = 0  # their sampled tokens
        # (ts, episodes, tokens) at the (re)start and at each ship since: the last few
        self._marks: deque[tuple[float, int, int]] = deque(maxlen=THROUGHPUT_WINDOW)

    def feed(self, ts: float, event) -> list[Row]:
        self.state = evolve_from(self.state, event)
        kind = event.kind
        if kind == "episode_completed":
            self._episodes += 1
            self._tokens += event.sampled_tokens
        elif kind == "batch_shipped":
            return self._ship_rows(ts, event)
        elif kind == "version_published" and event.metrics:
            return [(event.version, TRAINER_PREFIX + name, value) for name, value in event.metrics.items()]
        elif kind == "eval_completed":
            return [
                (event.version, f"{EVAL_PREFIX}{event.env}/{name}", getattr(event, name))
                for name in EVAL_FIGURES
                if getattr(event, name) is not None
            ]
        elif kind in ("run_started", "run_resumed"):  # the time between a stop and its resume is no one's
            self._episodes = self._tokens = 0
            self._marks.clear()
            self._marks.append((ts, 0, 0))
        return []

    def _ship_rows(self, ts: float, e: ev.BatchShipped) -> list[Row]:
        s = self.state
        assert s is not None  # a batch ships only after run_started built the state
        dropped = wasted_samples(s.acct)
        rows = [
            (e.step, "reward/mean", e.reward_mean),
            (e.step, "lag/max", e.off_policy_max),
            (e.step, "lag/mean", e.off_policy_mean),
            (e.step, "batch/samples", len(e.sample_ids)),
            (e.step, "batch/tokens", e.n_tokens),
            (e.step, "queue/buffered", buffered_episodes(s)),
            (e.step, "queue/finalizing", sum(s.finalizing.values())),
            (e.step, "version", s.version),
            (e.step, "waste/dropped", dropped),
            (e.step, "waste/pct", 100.0 * dropped / s.acct.completed_samples if s.acct.completed_samples else 0.0),
        ]
        if self._marks and ts > self._marks[0][0]:
            since, episodes, tokens = self._marks[0]
            rows += [
                (e.step, "throughput/episodes_per_s", (self._episodes - episodes) / (ts - since)),
                (e.step, "throughput/tokens_per_s", (self._tokens - tokens) / (ts - since)),
            ]
        self._marks.append((ts, self._episodes, self._tokens))
        return rows


def fold_events(
    log: EventLog, consume: Callable[[float, object], Iterable[T] | None], start: int = 1, stop: int | None = None
) -> Iterator[tuple[int, float, T]]:
    """Hand each of the log's events `start..stop` to `consume(ts, event)`, in log order, and yield
    (seq, ts, item) for what it returns. FoldError names the seq of an event this code cannot read,
    or that contradicts the state (`consume` folds it with `evolve`: `InconsistentEvent`)."""
    for seq, ts, kind, data in log.read_raw(start, stop):
        try:
            event = ev.decode_event(kind, data)  # a trace without its token arrays (its payload is not read)
        except DECODE_ERRORS as err:
            raise FoldError(seq, kind, err) from None
        try:
            out = consume(ts, event)
        except InconsistentEvent as err:
            raise FoldError(seq, kind, err) from None
        for item in out or ():
            yield seq, ts, item


def log_rows(
    log: EventLog, rows: StepRows | None = None, start: int = 1, stop: int | None = None
) -> Iterator[tuple[int, float, Row]]:
    """(seq and ts of the event that completed it, row) for every row of the log's events
    `start..stop`, folded into `rows` (a new StepRows by default)."""
    return fold_events(log, (StepRows() if rows is None else rows).feed, start, stop)
