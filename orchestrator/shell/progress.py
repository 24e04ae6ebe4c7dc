"""The progress line (one per shipped batch, folded on a narrow terminal), what sampling did
before the first one, the waste warning, and the final summary. On a terminal, a live bar with
the steps done, the newest reward and lag, and an ETA stays below the lines; in a pipe or CI, the
plain lines only."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TaskID, TextColumn, TimeRemainingColumn
from rich.progress import Progress as Bar
from rich.table import Table

from orchestrator.core.state import (
    DROP_REASONS,
    Accounting,
    State,
    conservation,
    state_hash,
    wasted_by_reason,
    wasted_samples,
)
from orchestrator.figures import eval_figures_line, eval_result_dict
from orchestrator.notices import warn
from orchestrator.observe.rows import buffered_episodes

WASTE_WINDOW_STEPS = 5  # the warning looks at the completions of this many steps
WASTE_WARNING_SHARE = 0.2  # ... and warns when more than this share of them was dropped
FOLD_INDENT = "    "  # a folded step line's continuation


def step_parts(event, state: State, step_time: float) -> list[str]:
    """The step line's parts, the essentials first (a narrow terminal folds the rest below): the
    step, its mean reward, its lag, the version, the waste so far, the step's time, then the run's
    queue (buffered, in flight, finalizing where any) and the newest eval."""
    acct = state.acct
    parts = [
        f"step {event.step:>4}/{state.params.max_steps}",
        f"reward {event.reward_mean:.3f}",
        f"lag {event.off_policy_mean:.2f} max {event.off_policy_max}",
        f"v{state.version}",
        f"waste {waste_share(wasted_samples(acct), acct.completed_samples):.1%}",
        f"{step_time:.2f}s" if step_time < 10 else f"{step_time:.1f}s",
        f"buffered {buffered_episodes(state)} in-flight {len(state.inflight)}",
    ]
    finalizing = sum(state.finalizing.values())
    if finalizing:
        parts.append(f"finalizing {finalizing}")
    if state.evals.results:  # the newest eval's mean reward, and the version it evaluated
        r = state.evals.results[-1]
        parts.append(f"eval v{r.version} {'-' if r.reward_mean is None else f'{r.reward_mean:.3f}'}")
    return parts


def waste_share(dropped: int, completed: int) -> float:
    return dropped / completed if completed else 0.0


class Progress:
    def __init__(self, console: Console | None = None, every: int = 1, warn: Callable[[str], None] = warn):
        self.console = console or Console(highlight=False, soft_wrap=True)
        self.every = every
        self.warn = warn
        self.rewards: dict[int, float] = {}  # by step, of the steps shipped in this segment
        self.started = self._last = time.monotonic()
        # (shipped + dropped, dropped for the settings' reasons) after each of the last steps
        self._recent: deque[tuple[int, dict[str, int]]] = deque(maxlen=WASTE_WINDOW_STEPS + 1)
        self._warned_at: int | None = None  # step of the last waste warning
        self._bar: Bar | None = None
        self._bar_task: TaskID | None = None
        self._told_first = False  # the first completions told (in a pipe)
        self._completed_before = 0  # completions before this segment (a resume's)
        self._shipped_before = 0  # steps before this segment (a resume's)

    def resumed_at(self, state: State) -> None:
        """The state a resume starts from: this segment's figures count from it."""
        self._completed_before = state.acct.completed
        self._shipped_before = state.step - 1

    @contextmanager
    def live(self, total_steps: int, done_steps: int) -> Iterator[None]:
        """Show the live bar while the block runs, if the console is a terminal: the steps, the
        newest step's reward and lag (before the first: the episodes done), the ETA; under 80
        columns."""
        if not self.console.is_terminal:
            yield
            return
        self._bar = Bar(
            TextColumn("steps"),
            BarColumn(bar_width=16),
            MofNCompleteColumn(),
            TextColumn("{task.fields[status]}"),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=self.console,
        )
        self._bar_task = self._bar.add_task("steps", total=total_steps, completed=done_steps, status="starting")
        try:
            with self._bar:
                yield
        finally:
            self._bar = None

    def on_commit(self, state: State) -> None:
        """Before this segment's first step: what sampling has done so far (a run's first batch can
        take a while), on the live bar, and in a pipe once, with the first completions."""
        if self.rewards:  # a step shipped in this segment
            return
        done, inflight = state.acct.completed - self._completed_before, len(state.inflight)
        if self._bar is not None and self._bar_task is not None:
            self._bar.update(self._bar_task, status=f"sampling: {done} episodes done, {inflight} in flight")
        elif done and not self._told_first:
            self._told_first = True
            p = state.params
            batch = f"{p.token_batch_size} tokens" if p.token_batch_size is not None else f"{p.batch_size} samples"
            self.console.print(
                f"sampling: {done} episodes done after {time.monotonic() - self.started:.1f}s, {inflight} in flight; "
                f"a step ships a batch of {batch}"
            )

    def on_batch(self, event, state: State, loop) -> None:
        now = time.monotonic()
        step_time, self._last = now - self._last, now
        self.rewards[event.step] = event.reward_mean
        self._check_waste(event.step, state.acct)
        if self._bar is not None and self._bar_task is not None:
            status = f"reward {event.reward_mean:.3f} lag {event.off_policy_mean:.2f}"
            self._bar.update(
                self._bar_task, completed=event.step, total=state.params.max_steps, status=status, refresh=True
            )
        if event.step % self.every and event.step != state.params.max_steps:
            return
        self._print_folded(step_parts(event, state, step_time))

    def _print_folded(self, parts: list[str]) -> None:
        """The parts joined by " | " on one line; on a terminal narrower than that, folded at the
        separators into lines that fit, the continuations indented (in a pipe: one line a step)."""
        line = " | ".join(parts)
        width = self.console.width
        if not self.console.is_terminal or len(line) <= width:
            self.console.print(line)
            return
        lines = [parts[0]]
        for part in parts[1:]:
            if len(lines[-1]) + 3 + len(part) <= width:
                lines[-1] += " | " + part
            else:
                lines.append(FOLD_INDENT + part)
        self.console.print("\n".join(lines))

    def on_eval(self, event) -> None:
        """One line per eval result (`eval_completed`)."""
        self.console.print(f"eval {event.env} v{event.version} | {eval_figures_line(event)}")

    def _check_waste(self, step: int, acct: Accounting) -> None:
        """Warn when more than WASTE_WARNING_SHARE of the completions whose fate the last steps
        decided (shipped or dropped) were dropped, naming what drives each of the main reasons;
        at most once per window. (Against the completions of the window alone, drops of earlier
        completions could make the share exceed one.)"""
        dropped = wasted_by_reason(acct)
        self._recent.append((acct.shipped + sum(acct.dropped.values()), dropped))
        if len(self._recent) <= WASTE_WINDOW_STEPS:
            return
        if self._warned_at is not None and step - self._warned_at < WASTE_WINDOW_STEPS:
            return
        decided_before, dropped_before = self._recent[0]
        decided = self._recent[-1][0] - decided_before
        recent = {reason: n - dropped_before.get(reason, 0) for reason, n in dropped.items()}
        recent = {reason: n for reason, n in sorted(recent.items(), key=lambda kv: -kv[1]) if n > 0}
        total = sum(recent.values())
        share = waste_share(total, decided)
        if share <= WASTE_WARNING_SHARE:
            return
        self._warned_at = step
        causes = "; ".join(
            f"{reason} {n}: {DROP_REASONS[reason]}" for reason, n in recent.items() if 10 * n >= total
        )  # the reasons that matter, not every stray drop
        self.warn(
            f"{share:.0%} of the {decided} completions shipped or dropped in the last {WASTE_WINDOW_STEPS} "
            f"steps were dropped (step {step}); {causes}"
        )

    def summary(self, state: State, run_dir) -> dict:
        steps = sorted(self.rewards)
        first, last = reward_windows([self.rewards[s] for s in steps])
        holds, terms = conservation(state)
        acct = state.acct
        out: dict[str, Any] = {
            "run_dir": str(run_dir),
            "stop_reason": state.stop_reason,
            "steps": len(steps),
            "reward_first5": sum(first) / len(first) if first else None,
            "reward_last5": sum(last) / len(last) if last else None,  # None (n/a): one step, no gain to show
            "reward_gain": sum(last) / len(last) - sum(first) / len(first) if first and last else None,
            "wall_s": time.monotonic() - self.started,
            "conservation": holds,
            **terms,
            "generated_episodes": acct.completed,
            "generated_samples": acct.completed_samples,
            "generated_tokens": acct.completed_tokens,
            "trained_episodes": acct.shipped,
            "trained_tokens": acct.shipped_tokens,
            "dropped_by_reason": dict(sorted(acct.dropped.items())),
            "cancelled_in_flight": acct.cancelled_attempts,
            "waste_pct": round(100 * waste_share(wasted_samples(acct), acct.completed_samples), 2),
            "state_hash": state_hash(state),
            "segment_first_step": self._shipped_before + 1,
            "run_steps": state.step - 1,
        }
        if state.params is not None and state.params.eval is not None:
            out["evals"] = [eval_result_dict(r) for r in state.evals.results]
        self.console.print(self._summary_table(out))
        return out

    def _summary_table(self, out: dict[str, Any]) -> Table:
        """The summary as a table. A resumed run's separates this segment's figures (its steps,
        their rewards, its wall time) from the run's totals over every segment."""
        resumed = self._shipped_before > 0
        title = "orch run summary"
        if resumed:
            title += f": this segment (steps {out['segment_first_step']}..{out['run_steps']}), then the whole run"
        table = Table(title=title, show_header=False)
        rows = {key: value for key, value in out.items() if key not in ("segment_first_step", "run_steps")}
        if resumed:
            segment = {f"{key} (this segment)": rows.pop(key) for key in SEGMENT_FIGURES}
            rows = {**segment, "run_dir": rows.pop("run_dir"), "steps (the run)": out["run_steps"], **rows}
        for key, value in rows.items():
            if key == "run_dir" and resumed:
                table.add_section()
            if key == "evals":
                for r in value:
                    table.add_row(f"eval {r['env']} v{r['version']}", eval_figures_line(r))
                continue
            if isinstance(value, dict):
                value = ", ".join(f"{reason} {n}" for reason, n in value.items()) or "none"
            elif value is None and key.startswith("reward_"):
                value = "n/a"
            table.add_row(key, f"{value:.3f}" if isinstance(value, float) else str(value))
        return table


REWARD_WINDOW_STEPS = 5
# The summary's figures of this segment alone (a resumed run's steps since the resume).
SEGMENT_FIGURES = ("steps", "reward_first5", "reward_last5", "reward_gain", "wall_s")


def reward_windows(rewards: list[float]) -> tuple[list[float], list[float]]:
    """The first and last steps' rewards the summary compares: 5 each, or each half of a run
    of fewer than 10 steps, so that they never share a step (a 3-step run's gain would else be
    0 by construction); none for a single step (the gain is n/a)."""
    window = min(REWARD_WINDOW_STEPS, len(rewards) // 2)
    if window == 0:
        return (rewards[:1], []) if rewards else ([], [])
    return rewards[:window], rewards[-window:]
