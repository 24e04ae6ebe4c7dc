"""An episode's training samples (docs/rules.md, "Samples").

An episode completes with one sample, or several (`EpisodeCompleted.samples`: an agentic episode
whose context was rewritten, that branched, or that has several trainable agents). The group
scores its episodes; when it settles, each episode is split into its samples, and from there the
queue, the staleness sweep, the batch cut and the batch file deal in samples, each under its own
id (`events.sample_id`) and with its own oldest version. A one-sample episode is its own sample,
under its own id: nothing is split.
"""

from __future__ import annotations

from orchestrator.core.events import EpisodeCompleted, sample_id, version_runs


def seat_of(agent: str) -> str:
    """The seat an agent plays: `name` for `name#k` (the k-th trace of a seat that played several
    in one episode, e.g. best-of-n's attempts), else the agent itself. The agents of one seat are
    scored in one pool (docs/rules.md, "Samples")."""
    return agent.partition("#")[0]


def sample_count(episode: EpisodeCompleted) -> int:
    """How many samples an episode holds: a failed or one-sample episode counts one."""
    return len(episode.samples) or 1


def split_episode(episode: EpisodeCompleted) -> list[EpisodeCompleted]:
    """An episode's samples as traces of their own (a one-sample episode: itself), each under its
    sample id, with its reward, its agent, its part of the arrays (read from the episode's when
    first read: a fold splits episodes whose payloads it has not read) and the versions of its
    own sampled tokens: the episode's runs cut at each sample's end (a backend that told only the
    episode's bounds gives each sample those bounds)."""
    if not episode.samples:
        return [episode]
    rewards = dict(episode.agent_rewards)
    runs = [list(run) for run in episode.token_versions]
    parts, start, run = [], 0, 0
    for index, (n_tokens, sampled) in enumerate(episode.samples):
        agent = episode.agents[index] if episode.agents else None
        oldest, newest = episode.policy_start, episode.policy_end
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
        parts.append(
            EpisodeCompleted(
                episode_id=sample_id(episode.episode_id, index),
                group_id=episode.group_id,
                ok=True,
                reward=rewards.get(agent, episode.reward) if agent is not None else episode.reward,
                tokens=episode.tokens.part(start, n_tokens, sampled),  # type: ignore[union-attr]
                policy_start=oldest,
                policy_end=newest,
                temperature=episode.temperature,
                token_versions=own,
                agents=(agent,) if agent is not None else (),
            )
        )
        start += n_tokens
    return parts


def trainable_starts(episode: EpisodeCompleted) -> list[int]:
    """The oldest version of each sample with a sampled token: what staleness judges."""
    return [sample.policy_start for sample in split_episode(episode) if sample.sampled_tokens]
