"""An episode's training samples (docs/rules.md, "Samples").

An episode completes with one sample, or several (`EpisodeCompleted.samples`: an agentic episode
whose context was rewritten, that branched, or that has several trainable agents). The group
scores its episodes; when it settles, each episode is split into its samples, and from there the
queue, the staleness sweep, the batch cut and the batch file deal in samples, each under its own
id (`events.sample_id`) and with its own oldest version. A one-sample episode is its own sample,
under its own id: nothing is split.
"""

from __future__ import annotations

from typing import NamedTuple

from orchestrator.core.events import EpisodeCompleted, sample_id, version_runs


class SampleHead(NamedTuple):
    """A sample's scalars, read from its episode's fields alone (no token arrays): what a fold
    needs to queue, sweep and cut it."""

    trace_id: int
    start: int  # the first of its tokens in the episode's arrays
    n_tokens: int
    sampled_tokens: int
    reward: float
    policy_start: int
    policy_end: int
    token_versions: tuple[tuple[int, int], ...]
    agent: str | None


def seat_of(agent: str) -> str:
    """The seat an agent plays: `name` for `name#k` (the k-th trace of a seat that played several
    in one episode, e.g. best-of-n's attempts), else the agent itself. The agents of one seat are
    scored in one pool (docs/rules.md, "Samples")."""
    return agent.partition("#")[0]


def sample_count(trace) -> int:
    """How many samples a trace holds: a failed or one-sample episode counts one."""
    return len(trace.samples) or 1


def sample_heads(trace) -> list[SampleHead]:
    """The samples of a several-sample episode (an `EpisodeCompleted` or its fold view), each
    with the versions of its own sampled tokens: the episode's runs cut at each sample's end
    (a backend that told only the episode's bounds gives each sample those bounds)."""
    rewards = dict(trace.agent_rewards)
    runs = [list(run) for run in trace.token_versions]
    heads, start, run = [], 0, 0
    for index, (n_tokens, sampled) in enumerate(trace.samples):
        agent = trace.agents[index] if trace.agents else None
        oldest, newest = trace.policy_start, trace.policy_end
        own: tuple[tuple[int, int], ...] = ()
        if runs and sampled:
            segments, left = [], sampled
            while left:
                version, available = runs[run]
                taken = min(available, left)
                segments.append((version, taken))
                left -= taken
                runs[run][1] -= taken
                run += not runs[run][1]
            versions = [version for version, _ in segments]
            oldest, newest, own = min(versions), max(versions), version_runs(segments)
        heads.append(
            SampleHead(
                sample_id(trace.episode_id, index),
                start,
                n_tokens,
                sampled,
                rewards.get(agent, trace.reward) if agent is not None else trace.reward,
                oldest,
                newest,
                own,
                agent,
            )
        )
        start += n_tokens
    return heads


def trainable_starts(trace) -> list[int]:
    """The oldest version of each sample with a sampled token: what staleness judges."""
    if not trace.samples:
        return [trace.policy_start] if trace.sampled_tokens else []
    return [head.policy_start for head in sample_heads(trace) if head.sampled_tokens]


def sample_of_head(episode: EpisodeCompleted, head: SampleHead) -> EpisodeCompleted:
    """One sample of a several-sample episode, as a trace of its own: its slice of the arrays,
    its reward, versions and agent, under its sample id."""
    end = head.start + head.n_tokens
    return EpisodeCompleted.unvalidated(
        episode_id=head.trace_id,
        group_id=episode.group_id,
        ok=True,
        reward=head.reward,
        token_ids=episode.token_ids[head.start : end],
        mask=episode.mask[head.start : end],
        logprobs=episode.logprobs[head.start : end],
        policy_start=head.policy_start,
        policy_end=head.policy_end,
        temperature=episode.temperature,
        error=None,
        token_versions=head.token_versions,
        samples=(),
        agents=(head.agent,) if head.agent is not None else (),
        agent_rewards=(),
    )


def split_episode(episode: EpisodeCompleted) -> list[EpisodeCompleted]:
    """An episode's samples as traces of their own (a one-sample episode: itself)."""
    if not episode.samples:
        return [episode]
    return [sample_of_head(episode, head) for head in sample_heads(episode)]
