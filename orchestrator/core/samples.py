"""An episode's training samples (docs/rules.md, "Samples").

An episode completes with one sample, or several (`EpisodeCompleted.samples`: an agentic episode
whose context was rewritten, that branched, or that has several trainable agents). The group
scores its episodes; when it settles, each episode is split into its samples, and from there the
queue, the staleness sweep, the batch cut and the batch file deal in samples, each under its own
id (`events.sample_id`) and with its own oldest version. A one-sample episode is its own sample,
under its own id: nothing is split.
"""

from __future__ import annotations

from array import array
from typing import ClassVar

import msgspec

from orchestrator.core.arrays import Tokens
from orchestrator.core.events import EpisodeCompleted, sample_id, version_runs


class Sample(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """One training sample of a several-sample episode whose group settled, held under its sample
    id until it ships or is dropped: its part of the episode's arrays, the reward it trains on
    (its agent's, or the episode's), the versions of its own sampled tokens."""

    sample_id: int
    episode_id: int
    group_id: int
    reward: float
    tokens: Tokens
    policy_start: int  # its oldest sampled token's version
    policy_end: int
    temperature: float
    token_versions: tuple[tuple[int, int], ...] = ()
    agent: str | None = None
    ok: ClassVar[bool] = True  # a sample is of an ok episode
    samples: ClassVar[tuple[tuple[int, int], ...]] = ()  # it is its own one sample

    @property
    def trace_id(self) -> int:
        return self.sample_id

    @property
    def n_tokens(self) -> int:
        return self.tokens.n_tokens

    @property
    def sampled_tokens(self) -> int:
        return self.tokens.sampled_tokens

    @property
    def token_ids(self) -> array:
        return self.tokens.token_ids

    @property
    def mask(self) -> bytes:
        return self.tokens.mask

    @property
    def logprobs(self) -> array:
        return self.tokens.logprobs


def seat_of(agent: str) -> str:
    """The seat an agent plays: `name` for `name#k` (the k-th trace of a seat that played several
    in one episode, e.g. best-of-n's attempts), else the agent itself. The agents of one seat are
    scored in one pool (docs/rules.md, "Samples")."""
    return agent.partition("#")[0]


def sample_count(trace: EpisodeCompleted | Sample) -> int:
    """How many samples a held trace holds: a failed or one-sample episode counts one."""
    return len(trace.samples) or 1


def split_episode(episode: EpisodeCompleted) -> list[EpisodeCompleted] | list[Sample]:
    """An episode's samples (a one-sample episode is its own sample: itself), each under its
    sample id, with its reward, its agent, its part of the arrays (read from the episode's when
    first read: a fold splits episodes whose payloads it has not read) and the versions of its
    own sampled tokens: the episode's runs cut at each sample's end (a backend that told only the
    episode's bounds gives each sample those bounds)."""
    if not episode.samples:
        return [episode]
    assert episode.tokens is not None, "an episode of several samples has tokens"
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
            Sample(
                sample_id=sample_id(episode.episode_id, index),
                episode_id=episode.episode_id,
                group_id=episode.group_id,
                reward=rewards.get(agent, episode.reward) if agent is not None else episode.reward,
                tokens=episode.tokens.part(start, n_tokens, sampled),
                policy_start=oldest,
                policy_end=newest,
                temperature=episode.temperature,
                token_versions=own,
                agent=agent,
            )
        )
        start += n_tokens
    return parts


def trainable_starts(episode: EpisodeCompleted) -> list[int]:
    """The oldest version of each sample with a sampled token: what staleness judges."""
    return [sample.policy_start for sample in split_episode(episode) if sample.sampled_tokens]
