"""The one interpreter of decisions: what each logged event calls for outside the core.

Every driver of the core (the asyncio loop, the simulator, `orch replay --reexecute`) hands the
events of one step, inputs and their decisions in log order and already folded into the state,
to `perform`, which calls the driver's `EffectPort`. The drivers implement the port and decide
nothing themselves: when a decision calls for an effect is written here once. A port may defer
an effect (the loop writes batch files in a thread after the pass), never reorder or skip one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol

from orchestrator.core import events as ev
from orchestrator.core.state import Group, State, finalizes_in_background, member


class EffectPort(Protocol):
    def start_rollout(self, dispatched: ev.EpisodeDispatched, group: Group) -> None:
        """Run the episode (its task is the group's)."""

    def cancel_rollout(self, episode_id: int) -> None:
        """Cancel the episode's rollout; its completion, if one still comes, is late."""

    def start_eval_rollout(self, dispatched: ev.EvalEpisodeDispatched) -> None:
        """Run the eval episode, pinned to its eval's version."""

    def cancel_eval_rollout(self, episode_id: int) -> None:
        """Cancel the eval episode's rollout; its eval stays open."""

    def report_eval(self, completed: ev.EvalCompleted) -> None:
        """Show an eval's result."""

    def start_finalize(self, started: ev.FinalizeStarted, episodes: list[ev.EpisodeCompleted]) -> None:
        """Score the group in the background; the result comes back as an input."""

    def cancel_finalize(self, group_id: int) -> None:
        """Cancel the group's background finalize, if it has one."""

    def write_batch(self, shipped: ev.BatchShipped) -> None:
        """Write the shipped batch's file for the trainer."""

    def notify_trainer(self, shipped: ev.BatchShipped) -> None:
        """Tell the trainer the batch is there: after every batch file of the step is written."""

    def load_version(self, version: int) -> None:
        """Load the published weights for inference."""

    def drain(self) -> None:
        """Stop admitting rollouts; the core already cancelled every in-flight episode."""

    def snapshot(self) -> None:
        """Save a snapshot of the state: the run stopped."""


class IgnoringPort:
    """A port that ignores every effect: the base of the drivers that play the world themselves
    (the simulator, re-execution), which override the effects their world answers."""

    def start_rollout(self, dispatched: ev.EpisodeDispatched, group: Group) -> None: ...
    def cancel_rollout(self, episode_id: int) -> None: ...
    def start_eval_rollout(self, dispatched: ev.EvalEpisodeDispatched) -> None: ...
    def cancel_eval_rollout(self, episode_id: int) -> None: ...
    def report_eval(self, completed: ev.EvalCompleted) -> None: ...
    def start_finalize(self, started: ev.FinalizeStarted, episodes: list[ev.EpisodeCompleted]) -> None: ...
    def cancel_finalize(self, group_id: int) -> None: ...
    def write_batch(self, shipped: ev.BatchShipped) -> None: ...
    def notify_trainer(self, shipped: ev.BatchShipped) -> None: ...
    def load_version(self, version: int) -> None: ...
    def drain(self) -> None: ...
    def snapshot(self) -> None: ...


def _start_rollout(s: State, e: ev.EpisodeDispatched, port: EffectPort) -> None:
    if e.episode_id in s.inflight:  # not cancelled by a later decision of the same step
        port.start_rollout(e, s.groups[e.group_id])


def _cancel_rollout(s: State, e: ev.EpisodeCancelled, port: EffectPort) -> None:
    port.cancel_rollout(e.episode_id)


def _start_eval_rollout(s: State, e: ev.EvalEpisodeDispatched, port: EffectPort) -> None:
    if e.episode_id in s.evals.inflight:  # not cancelled by a later decision of the same step
        port.start_eval_rollout(e)


def _cancel_eval_rollout(s: State, e: ev.EvalEpisodeCancelled, port: EffectPort) -> None:
    port.cancel_eval_rollout(e.episode_id)


def _report_eval(s: State, e: ev.EvalCompleted, port: EffectPort) -> None:
    port.report_eval(e)


def _start_finalize(s: State, e: ev.FinalizeStarted, port: EffectPort) -> None:
    if finalizes_in_background(s, e):
        port.start_finalize(e, [member(s, episode_id) for episode_id in e.episode_ids])


def _cancel_finalize(s: State, e: ev.GroupCancelled, port: EffectPort) -> None:
    port.cancel_finalize(e.group_id)


def _write_batch(s: State, e: ev.BatchShipped, port: EffectPort) -> None:
    port.write_batch(e)


def _load_version(s: State, e: ev.VersionPublished, port: EffectPort) -> None:
    port.load_version(e.version)


def _drain(s: State, e: ev.DrainStarted, port: EffectPort) -> None:
    port.drain()


def _snapshot(s: State, e: ev.RunStopped, port: EffectPort) -> None:
    port.snapshot()


# kind -> its effect; a kind missing here calls for none. `version_published` is an input: the
# only input with an effect.
_EFFECTS: dict[str, Callable[[State, Any, EffectPort], None]] = {
    "episode_dispatched": _start_rollout,
    "episode_cancelled": _cancel_rollout,
    "eval_episode_dispatched": _start_eval_rollout,
    "eval_episode_cancelled": _cancel_eval_rollout,
    "eval_completed": _report_eval,
    "finalize_started": _start_finalize,
    "group_cancelled": _cancel_finalize,
    "batch_shipped": _write_batch,
    "version_published": _load_version,
    "drain_started": _drain,
    "run_stopped": _snapshot,
}
assert set(_EFFECTS) <= set(ev.EVENT_TYPES)


def perform(state: State, events: Iterable[ev.Event], port: EffectPort) -> None:
    """Call `port` for every effect `events` (one step's, in log order) call for, in that order;
    the trainer hears of the step's batches once they are all written."""
    effects = _EFFECTS
    shipped = []
    for event in events:
        effect = effects.get(event.kind)
        if effect is not None:
            effect(state, event, port)
            if isinstance(event, ev.BatchShipped):
                shipped.append(event)
    for event in shipped:
        port.notify_trainer(event)
