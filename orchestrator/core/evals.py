"""The eval rules (docs/evals.md): held-out tasks sampled on a schedule, beside training.

Evals are traffic of their own beside train dispatch (docs/rules.md, 1. Dispatch): dispatched by
the core as their own groups, never through the train dispatch gate (so a closed gate, for any
reason, does not hold them back), limited by their own concurrency (`EvalParams.max_inflight`),
never trained on and never counted in the train accounting (`State.evals` has its own). Each eval
is pinned to the version it was started for: a result sampled by another version is counted as
`off_version`, never mixed into the figures. `decide` calls these rules; like every rule they
change the state only by emitting events (folded by `evolve`).
"""

from __future__ import annotations

from typing import Literal

from orchestrator.core import events as ev
from orchestrator.core.state import Eval, State


def held_out_task_ids(num_tasks: int) -> list[int]:
    """The held-out tasks of every env: the negative indices of its task space. The train
    sampler's cursor starts at 0 and only moves up (rule 1), so it can never reach them; envs
    with task content keep the two halves apart by content too (docs/evals.md)."""
    return [-(i + 1) for i in range(num_tasks)]


def eval_due(s: State) -> bool:
    """An eval is due at version 0, at every `every`-th version, and at the last version (the
    run's end); a version reached by a jump counts for the multiples it passed."""
    p = s.params
    if p.eval is None or s.stopped:
        return False
    last = s.evals.last_version
    if s.version <= last:
        return False
    return s.version // p.eval.every > last // p.eval.every or s.version >= p.max_steps


def start_due_evals(d) -> None:
    s = d.state
    if not eval_due(s):
        return
    p = s.params.eval
    for env in p.envs:
        d.emit(
            ev.EvalStarted(
                eval_id=s.evals.next_eval_id,
                env=env,
                version=s.version,
                task_ids=held_out_task_ids(p.num_tasks),
                first_group_id=s.next_group_id,
                samples_per_task=p.samples_per_task,
                temperature=p.temperature,
            )
        )


def dispatch_eval_episodes(d) -> None:
    """Fill the eval permits, oldest eval first, each sample pinned to its eval's version."""
    s = d.state
    evals = s.evals
    if s.params.eval is None:
        return
    max_inflight = s.params.eval.max_inflight
    while len(evals.inflight) < max_inflight:
        x = next((x for x in evals.open.values() if x.to_dispatch), None)
        if x is None:
            return
        sample = min(x.to_dispatch)
        task = sample // x.samples_per_task
        d.emit(
            ev.EvalEpisodeDispatched(
                episode_id=s.next_episode_id,
                eval_id=x.eval_id,
                group_id=x.first_group_id + task,
                task_id=x.task_ids[task],
                sample=sample,
                attempt=x.attempts,
                policy_version=x.version,
            )
        )


def run_evals(d) -> None:
    """Start what is due, fill the eval permits (the tail of every rule that may change either)."""
    start_due_evals(d)
    dispatch_eval_episodes(d)


def evals_pending(s: State) -> bool:
    """Does the run still owe an eval? The drain waits for them (docs/evals.md)."""
    return bool(s.evals.open) or eval_due(s)


def eval_figures(x: Eval) -> dict:
    """Mean reward, pass@1 and pass@k (k = samples_per_task) over the scored samples, in sample
    order (the figures do not depend on the order the results came in)."""
    samples = sorted(x.scored)
    rewards = [x.scored[i][0] for i in samples]
    successes = [x.scored[i][1] for i in samples]
    figures: dict = {
        "reward_mean": sum(rewards) / len(rewards) if rewards else None,
        "pass_at_1": None,
        "pass_at_k": None,
        "tokens": sum(x.scored[i][2] for i in samples),
    }
    if samples and all(success is not None for success in successes):
        solved: dict[int, bool] = {}
        for i, success in zip(samples, successes, strict=True):
            task = i // x.samples_per_task
            solved[task] = solved.get(task, False) or success
        figures["pass_at_1"] = sum(successes) / len(successes)
        figures["pass_at_k"] = sum(solved.values()) / len(solved)
    return figures


def complete_eval(d, x: Eval) -> None:
    d.emit(
        ev.EvalCompleted(
            eval_id=x.eval_id,
            env=x.env,
            version=x.version,
            tasks=len(x.task_ids),
            k=x.samples_per_task,
            scored=len(x.scored),
            failures=x.failures,
            off_version=x.off_version,
            **eval_figures(x),
        )
    )


def on_eval_result(d, e: ev.EvalEpisodeCompleted) -> None:
    """The freed eval permit is refilled; a finished eval reports its figures."""
    dispatch_eval_episodes(d)
    x = d.state.evals.open[e.eval_id]
    if x.done:
        complete_eval(d, x)


def cancel_eval_episodes(d, reason: Literal["stop", "resume"]) -> None:
    """Stop (their rollouts are cancelled) or resume (they were lost in a crash): the in-flight
    eval episodes give their samples back. The evals stay open, so a resumed run finishes them:
    the same eval, the same samples, the same pinned version."""
    for episode_id in list(d.state.evals.inflight):
        d.emit(ev.EvalEpisodeCancelled(episode_id=episode_id, reason=reason))


def accepted_eval_result(s: State, e: ev.EvalEpisodeCompleted) -> bool:
    """False for a result nobody waits for; a result naming another eval than its episode's is
    refused (it would be scored for the wrong version)."""
    eval_id = s.evals.inflight.get(e.episode_id)
    if eval_id is not None and eval_id != e.eval_id:
        raise ValueError(
            f"eval episode {e.episode_id} completed for eval {e.eval_id}, but it was dispatched for eval {eval_id}"
        )
    return eval_id is not None
