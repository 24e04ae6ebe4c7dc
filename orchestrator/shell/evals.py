"""The shell's side of evals (docs/evals.md): an `eval_episode_dispatched` decision becomes a
rollout request for the same backends as train episodes, pinned to its eval's version at the
eval's temperature; the rollout's outcome comes back as an `eval_episode_completed` input."""

from __future__ import annotations

from collections.abc import Callable

from orchestrator.collection.collect import Outcome
from orchestrator.contracts import RolloutRequest, episode_error
from orchestrator.core import events as ev
from orchestrator.core.state import State

# An env's success notion for a reward (the "pass" of pass@k: `EnvComponent.solved`); None: it
# has none, and reports no pass@k.
Solved = Callable[[float], "bool | None"]


def eval_request(state: State, e: ev.EvalEpisodeDispatched) -> RolloutRequest:
    x = state.evals.open[e.eval_id]
    return RolloutRequest(
        e.episode_id,
        e.group_id,
        x.env,
        e.task_id,
        e.attempt,
        e.policy_version,
        eval_id=e.eval_id,
        temperature=state.params.eval.temperature,
    )


def eval_result(outcome: Outcome, solved: Solved) -> ev.EvalEpisodeCompleted:
    """The input for an eval rollout's outcome: a failure (the rollout raised or returned a
    failed episode) or the figures of its completion, with the versions that sampled it and
    whether it succeeded (`solved`: its env's success notion)."""
    req: RolloutRequest = outcome.example
    done: ev.EpisodeCompleted | None = outcome.result
    if outcome.exception is not None or not done.ok:
        error = done.error if outcome.exception is None else episode_error(outcome.exception)
        return ev.EvalEpisodeCompleted(
            episode_id=req.episode_id,
            eval_id=req.eval_id,
            ok=False,
            reward=0.0,
            policy_start=req.policy_version,
            policy_end=req.policy_version,
            error=error,
        )
    return ev.EvalEpisodeCompleted(
        episode_id=req.episode_id,
        eval_id=req.eval_id,
        ok=True,
        reward=done.reward,
        success=solved(done.reward),
        sampled_tokens=done.sampled_tokens,
        policy_start=done.policy_start,
        policy_end=done.policy_end,
    )
