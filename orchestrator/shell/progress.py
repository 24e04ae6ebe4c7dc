"""The progress line (one per shipped batch) and the final summary. On a terminal, a live bar
with the steps done and an ETA stays below the lines; in a pipe or CI, the plain lines only."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.progress import Progress as Bar
from rich.table import Table

from orchestrator.core.state import State, conservation, state_hash


def buffered_episodes(state: State) -> int:
    """Completed episodes waiting to train: queued, or held by groups still finalizing."""
    return len(state.pending) + sum(len(g.members) for g in state.groups.values() if g.finalizing)


class Progress:
    def __init__(self, console: Console | None = None, every: int = 1):
        self.console = console or Console(highlight=False, soft_wrap=True)
        self.every = every
        self.rewards: dict[int, float] = {}
        self.started = self._last = time.monotonic()
        self._bar: Bar | None = None
        self._bar_task = None

    @contextmanager
    def live(self, total_steps: int, done_steps: int) -> Iterator[None]:
        """Show the live bar while the block runs, if the console is a terminal."""
        if not self.console.is_terminal:
            yield
            return
        self._bar = Bar(TextColumn("steps"), BarColumn(), MofNCompleteColumn(), TextColumn("elapsed"),
                        TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), console=self.console)
        self._bar_task = self._bar.add_task("steps", total=total_steps, completed=done_steps)
        try:
            with self._bar:
                yield
        finally:
            self._bar = None

    def on_batch(self, event, state: State, loop) -> None:
        now = time.monotonic()
        step_time, self._last = now - self._last, now
        self.rewards[event.step] = event.reward_mean
        if self._bar is not None:
            self._bar.update(self._bar_task, completed=event.step, total=state.params.max_steps, refresh=True)
        if event.step % self.every and event.step != state.params.max_steps:
            return
        finalizing = sum(state.finalizing.values())
        latest_eval = ""
        if state.evals.results:  # the newest eval's mean reward, and the version it evaluated
            r = state.evals.results[-1]
            latest_eval = f" | eval v{r.version} {'-' if r.reward_mean is None else f'{r.reward_mean:.3f}'}"
        self.console.print(
            f"step {event.step:>4}/{state.params.max_steps} | reward {event.reward_mean:.3f} "
            f"| lag max {event.off_policy_max} mean {event.off_policy_mean:.2f} "
            f"| buffered {buffered_episodes(state)} | finalizing {finalizing} "
            f"| in-flight {len(state.inflight)} | v{state.version} | {step_time:.2f}s{latest_eval}"
        )

    def on_eval(self, event) -> None:
        """One line per eval result (`eval_completed`)."""
        self.console.print(f"eval {event.env} v{event.version} | {eval_figures_line(event)}")

    def summary(self, state: State, run_dir) -> dict:
        steps = sorted(self.rewards)
        first = [self.rewards[s] for s in steps[:5]]
        last = [self.rewards[s] for s in steps[-5:]]
        holds, terms = conservation(state)
        out = {
            "run_dir": str(run_dir), "stop_reason": state.stop_reason, "steps": len(steps),
            "reward_first5": sum(first) / len(first) if first else None,
            "reward_last5": sum(last) / len(last) if last else None,
            "wall_s": time.monotonic() - self.started, "conservation": holds, **terms,
            "state_hash": state_hash(state),
        }
        if state.params is not None and state.params.eval is not None:
            out["evals"] = [eval_result_dict(r) for r in state.evals.results]
        table = Table(title="orch run summary", show_header=False)
        for key, value in out.items():
            if key == "evals":
                for r in value:
                    table.add_row(f"eval {r['env']} v{r['version']}", eval_figures_line(r))
            else:
                table.add_row(key, f"{value:.3f}" if isinstance(value, float) else str(value))
        self.console.print(table)
        return out


def eval_result_dict(r) -> dict:
    """An eval's result (`EvalResult`) as the summaries show it."""
    return {"env": r.env, "version": r.version, "reward_mean": r.reward_mean, "pass_at_1": r.pass_at_1,
            "pass_at_k": r.pass_at_k, "k": r.k, "scored": r.scored, "tokens": r.tokens}


def eval_figures_line(r) -> str:
    """`reward 0.612 | pass@1 0.250 | pass@4 0.500 | 32 scored, 1234 tokens` from an eval's result
    (the `eval_completed` event or its summary dict)."""
    get = r.get if isinstance(r, dict) else lambda name: getattr(r, name)

    def fig(value) -> str:
        return "-" if value is None else f"{value:.3f}"

    return (f"reward {fig(get('reward_mean'))} | pass@1 {fig(get('pass_at_1'))} "
            f"| pass@{get('k')} {fig(get('pass_at_k'))} "
            f"| {get('scored')} scored, {get('tokens')} tokens")
