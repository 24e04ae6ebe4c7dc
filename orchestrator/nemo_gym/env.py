"""The `nemo_gym` env as the `openai` backend calls it: one NeMo Gym agent ``/run`` per orch episode.

Tasks: train task `i` (the env's cursor) is a row of the train rows, in an order a pure function
of (seed, pass over the rows) (:func:`orchestrator.envs.draw.task_index`), so a resumed run
sees the same tasks; eval task ``-i`` is the held-out rows' i-th, wrapping. An episode posts the
row to the agent's ``/run`` with orch's sampling in its ``responses_create_params``
(`temperature`, `max_output_tokens`) and its episode named in ``metadata``; the agent's model
calls come back to orch's route (:mod:`.route`), which samples them and records them. The reward
is the agent's (its resources server's ``/verify``). The samples are the recorded calls: a call
whose prompt extends the previous call's prompt and completion continues that sample (the new
prompt tokens unsampled), any other starts a new one; each call's completion has the version that
sampled it.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

import httpx

from orchestrator.contracts import ModelCalls, RolloutRequest, TrainingSample, episode_of_samples
from orchestrator.core.events import EpisodeCompleted
from orchestrator.envs.draw import task_index
from orchestrator.http_limits import pool_limits
from orchestrator.nemo_gym.config import Row
from orchestrator.nemo_gym.route import EPISODE_KEY, Call, Episode, ResponsesRoute
from orchestrator.notices import one_line


class NemoGymEpisodeError(RuntimeError):
    """A NeMo Gym episode that did not yield a scored sample; the message says why."""


def run_body(row: Row, key: str, temperature: float, max_tokens: int) -> Row:
    """The agent's ``/run`` body of a task row for the episode `key`: orch's sampling and the
    episode's name in its ``responses_create_params``."""
    params = dict(row["responses_create_params"])
    params["temperature"] = temperature
    params["max_output_tokens"] = max_tokens
    params["metadata"] = {**(params.get("metadata") or {}), EPISODE_KEY: key}
    return {**row, "responses_create_params": params}


def samples_of(calls: list[Call]) -> tuple[list[TrainingSample], list[tuple[int, int]] | None]:
    """The samples of an episode's calls (module docstring), and each completion's (version,
    tokens) where every call's version is exact (else None)."""
    samples: list[TrainingSample] = []
    for call in calls:
        last = samples[-1] if samples else None
        extends = last is not None and call.prompt_ids[: len(last.token_ids)] == last.token_ids
        sample = last if extends else TrainingSample([], [], [])
        added = call.prompt_ids[len(sample.token_ids) :]  # its whole prompt, for a new sample
        sample.token_ids.extend([*added, *call.completion_ids])
        sample.mask.extend([0] * len(added) + [1] * len(call.completion_ids))
        sample.logprobs.extend([0.0] * len(added) + call.logprobs)
        if not extends:
            samples.append(sample)
    exact = all(call.policy_start == call.policy_end for call in calls)
    segments = [(call.policy_start, len(call.completion_ids)) for call in calls if call.completion_ids]
    return samples, segments if exact else None


class NemoGymEnv:
    """An ``orchestrator.contracts.AgentEnv``: ``await env.episode(request, client)`` plays one
    episode through the agent (raising: a failed episode)."""

    def __init__(
        self,
        *,
        train: list[Row],
        held_out: list[Row],
        seed: int,
        temperature: float,
        max_tokens: int,
        agent_url: str,
        route: ResponsesRoute,
        episode_timeout_s: float,
        check_servers: Any = None,
    ):
        self.train, self.held_out, self.seed = train, held_out, seed
        self.temperature, self.max_tokens = temperature, max_tokens
        self.agent_url, self.episode_timeout_s = agent_url.rstrip("/"), episode_timeout_s
        self.route = route
        self._check_servers = check_servers  # raises once a server orch started has died
        self.http = httpx.AsyncClient(  # one connection per episode in flight, however many that is
            timeout=httpx.Timeout(episode_timeout_s, connect=10.0),
            limits=pool_limits(None),
            trust_env=False,
        )

    def row(self, task_id: int) -> Row:
        if task_id >= 0:
            return self.train[task_index(self.seed, task_id, len(self.train), "nemo_gym")]
        if not self.held_out:  # the component's check refuses evals without held-out rows
            raise NemoGymEpisodeError(f"held-out task {task_id} asked of env nemo_gym without held-out rows")
        return self.held_out[(-task_id - 1) % len(self.held_out)]

    async def episode(self, req: RolloutRequest, client: ModelCalls) -> EpisodeCompleted:
        if self._check_servers is not None:
            self._check_servers()
        temperature = self.temperature if req.temperature is None else req.temperature
        at_version = None if req.eval_id is None else req.policy_version
        key = self.route.key(req.episode_id)
        played = Episode(req.group_id, at_version, temperature, self.max_tokens)
        self.route.open(key, played, client)
        try:
            verified = await self._run(run_body(self.row(req.task_id), key, temperature, self.max_tokens), played)
        finally:  # cancelled too (drain, stop): orch's /run request and its model calls are dropped
            self.route.close(key)
        calls = played.calls
        reward = verified.get("reward")
        if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
            raise NemoGymEpisodeError(f"the agent's /run answered reward {reward!r:.80}, not a finite number")
        if not calls:
            raise NemoGymEpisodeError("the agent made no model call through orch's route")
        samples, segments = samples_of(calls)
        try:
            return episode_of_samples(
                req,
                samples,
                reward=float(reward),
                policy_start=min(c.policy_start for c in calls),
                policy_end=max(c.policy_end for c in calls),
                temperature=temperature,
                version_segments=segments or (),
            )
        except ValueError as err:
            raise NemoGymEpisodeError(f"its samples do not make an episode: {err}") from None

    async def _run(self, body: Row, played: Episode) -> dict[str, Any]:
        """The agent's answer to `body`'s /run; raises for a failed one: where a model call of the
        episode failed in orch's route first, that failure (an inference error stays one)."""
        try:
            async with asyncio.timeout(self.episode_timeout_s):
                response = await self.http.post(self.agent_url + "/run", json=body)
        except (TimeoutError, httpx.TimeoutException):
            raise NemoGymEpisodeError(
                f"the agent's /run ({self.agent_url}) took more than env.nemo_gym.episode_timeout_s="
                f"{self.episode_timeout_s:g}s"
            ) from None
        except httpx.HTTPError as err:
            raise NemoGymEpisodeError(f"the agent's /run ({self.agent_url}): {type(err).__name__}: {err}") from None
        if response.status_code != 200:
            if played.error is not None:
                raise played.error
            raise NemoGymEpisodeError(
                f"the agent's /run answered {response.status_code}: {one_line(response.text)[:300]}"
            )
        try:
            verified = response.json()
        except ValueError:
            raise NemoGymEpisodeError("the agent's /run answered no JSON") from None
        if not isinstance(verified, dict):
            raise NemoGymEpisodeError("the agent's /run answered no JSON object")
        return verified

    async def aclose(self) -> None:
        await asyncio.shield(self.http.aclose())
