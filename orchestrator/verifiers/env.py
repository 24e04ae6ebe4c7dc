"""The `verifiers` env as the `openai` backend calls it: one verifiers `run_slot` per orch episode.

Tasks: a train group's ``task_id`` (the env's cursor, in `group_dispatched`, from 0 up) picks a
task of the taskset deterministically from the run's seed (:func:`orchestrator.envs.draw.task_index`), so a resumed or
replayed run sees the same tasks; with `held_out`, from the tasks it does not name. An eval's task
``-i`` is the held-out tasks' i-th, in taskset order (docs/evals.md). An episode:
verifiers' `Env.run_slot` on that task, its model calls routed through the backend's inference
client (:mod:`.adapter`): the group pinned to one endpoint, retries on another, each call's
weight version recorded. Its samples: every trainable branch of every trainable trace (token ids,
sampled mask and logprobs exactly as vLLM saw and returned them), each sampled span's version
that of the call which answered it; with several trainable traces (agents), each trace's samples
name its agent and are scored by its reward. docs/verifiers.md, "What an episode is".

Cancellation (drain, stop, a stale group): the rollout's task is cancelled, which ends its harness
subprocess (verifiers kills its process group) and drops its model call in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrator.contracts import ModelCalls, RolloutRequest, TrainingSample, episode_of_samples
from orchestrator.core.events import EpisodeCompleted
from orchestrator.envs.draw import task_index
from orchestrator.verifiers import adapter
from orchestrator.verifiers.config import VerifiersSettings, load_env, split_taskset


class VerifiersEpisodeError(RuntimeError):
    """A verifiers episode that did not yield a sample; the message says why (an episode failure)."""


class TaskDraw:
    """Tasks of a verifiers taskset (or a view of one) by position: a finite one read whole, an
    infinite one read as far as drawn."""

    def __init__(self, taskset):
        self.size: int | None = None
        self._tasks: list = []
        self._stream = None
        if taskset.bounded:
            self._tasks = list(taskset)
            self.size = len(self._tasks)
        else:
            self._stream = iter(taskset)

    def at(self, position: int):
        if self._stream is not None:
            while len(self._tasks) <= position:
                self._tasks.append(next(self._stream))
        return self._tasks[position]


@dataclass
class Tally:
    """What the run should know about its episodes beside the log."""

    episodes: int = 0
    samples: int = 0
    split: int = 0  # episodes with a trace split into several trainable branches
    multi_agent: int = 0  # episodes with several trainable traces
    harness_s: float = 0.0  # wall time inside run_slot (verifiers: harness, model calls, scoring)
    orch_s: float = 0.0  # the rest of each episode (task draw, conversion)
    calls: int = 0
    route_s: float = 0.0  # orch's routing of the model calls, beyond their HTTP exchange (inside harness_s)

    def count(self, samples: int, split: int, several_agents: bool, records: list[adapter.CallRecord]) -> None:
        self.episodes += 1
        self.samples += samples
        self.split += split > 0
        self.multi_agent += several_agents
        self.calls += len(records)
        self.route_s += sum(c.route_s - c.http_s for c in records)


def uv_on_path() -> None:
    """verifiers' subprocess runtime runs `uv` from PATH (without one, it pip-installs one into
    ~/.local/bin from the network): the `uv` package's, installed beside orch, is put on it."""
    from uv import find_uv_bin

    bin_dir = str(Path(find_uv_bin()).parent)
    path = os.environ.get("PATH", "")
    if bin_dir not in path.split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + path


class VerifiersEnv:
    """An ``orchestrator.contracts.AgentEnv``: ``await env.episode(request, client)`` plays one
    episode of the taskset (raising: a failed episode)."""

    def __init__(
        self,
        section: VerifiersSettings,
        *,
        seed: int,
        temperature: float,
        max_tokens: int,
        model: str,
        renderer_model: str,
    ):
        uv_on_path()
        self.section, self.seed = section, seed
        self.temperature, self.max_tokens, self.model, self.renderer_model = (
            temperature,
            max_tokens,
            model,
            renderer_model,
        )
        self.env = load_env(section)
        taskset = self.env.taskset
        if section.held_out:
            train, held_out = split_taskset(taskset, section.held_out)
            self._train, self._held_out = TaskDraw(train), TaskDraw(held_out)
        else:
            self._train, self._held_out = TaskDraw(taskset), None
        self.route: adapter.GenerateRoute | None = None  # bound to the backend's client by the first episode
        self._client_config: Any = None
        self._contexts: dict[float, Any] = {}  # by sampling temperature
        self.tally = Tally()

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[None]:
        """verifiers' serving resources (its interception server) for the run; the route forgotten after."""
        try:
            async with self.env.serving():
                yield
        finally:
            if self.route is not None:
                adapter.forget(self.route)

    def task(self, task_id: int):
        """A train task (`task_id` >= 0: the env's cursor) or a held-out one (< 0: an eval's)."""
        if task_id >= 0:
            return self._train.at(task_index(self.seed, task_id, self._train.size, "verifiers"))
        if self._held_out is None:  # the component's check refuses evals without held-out tasks
            raise VerifiersEpisodeError(f"held-out task {task_id} asked of a taskset without env.verifiers.held_out")
        position = -task_id - 1
        return self._held_out.at(position if self._held_out.size is None else position % self._held_out.size)

    def _bind(self, client: ModelCalls, temperature: float) -> tuple[adapter.GenerateRoute, Any]:
        """The route of the run's model calls through `client`, and the verifiers ModelContext on
        it that samples at `temperature` (the run's, or an eval's)."""
        import verifiers.v1 as vf

        if self.route is None:
            self.route = adapter.GenerateRoute(client)
            self._client_config = adapter.client_config(self.route, self.renderer_model, self.section.renderer)
        elif self.route.client is not client:
            raise RuntimeError("a verifiers env samples through one inference client per run")
        context = self._contexts.get(temperature)
        if context is None:
            context = self._contexts[temperature] = vf.ModelContext(
                model=self.model,
                client=self._client_config,
                sampling=vf.SamplingConfig(temperature=temperature, max_tokens=self.max_tokens),
            )
        return self.route, context

    async def episode(self, req: RolloutRequest, client: ModelCalls) -> EpisodeCompleted:
        temperature = self.temperature if req.temperature is None else req.temperature
        route, context = self._bind(client, temperature)
        at_version = None if req.eval_id is None else req.policy_version  # an eval's pinned version
        loop = asyncio.get_running_loop()
        began = loop.time()
        (slot,) = self.env.slots(self.task(req.task_id), 1)
        sessions: list[str] = []

        def minted(trace) -> None:  # verifiers mints a trace before its first model call
            sessions.append(trace.id)
            route.open(trace.id, pin=req.group_id, at_version=at_version)

        sampled_at = loop.time()
        try:
            episode = await self.env.run_slot(slot, context, on_trace=minted)
        finally:  # cancelled too (drain, stop): its calls are forgotten with it
            calls = {session: route.close(session) for session in sessions}
        harness_s = loop.time() - sampled_at
        completed = completion(req, episode, calls, temperature, self.tally)
        self.tally.harness_s += harness_s
        self.tally.orch_s += loop.time() - began - harness_s
        return completed

    def report(self) -> str:
        t = self.tally

        def per(seconds: float) -> str:
            return f"{1000 * seconds / t.episodes:.1f} ms" if t.episodes else "-"

        per_episode = f"{t.samples / t.episodes:.2f}" if t.episodes else "-"
        return (
            f"orch: verifiers: {t.episodes} episodes, {t.samples} samples ({per_episode} per episode; "
            f"{t.split} episodes split into several branches, {t.multi_agent} with several trainable traces); "
            f"per episode: verifiers {per(t.harness_s)} (orch's routing of its {t.calls} model calls: "
            f"{per(t.route_s)}), orch {per(t.orch_s)}"
        )


def completion(req: RolloutRequest, episode, calls: dict, temperature: float, tally: Tally) -> EpisodeCompleted:
    """The orch episode of a verifiers episode whose traces' model calls are `calls` (trace id ->
    what the route recorded): its samples, rewards and versions (module docstring); raises
    VerifiersEpisodeError (a failed episode) if verifiers failed it or it yielded no sample."""
    if not episode.ok:
        raise VerifiersEpisodeError(_first_error(episode))
    traces = [t for t in episode.traces if t.agent is None or t.agent.trainable]
    labels = agent_labels(traces)
    several_agents = len(traces) > 1
    samples: list[TrainingSample] = []
    segments: list[tuple[int, int] | None] = []  # each sampled span's (version, tokens); None: unknown
    records: list[adapter.CallRecord] = []
    split = 0
    for trace, agent in zip(traces, labels):
        made = calls.get(trace.id)
        own = made.calls if made is not None else []
        records += own
        trainable = (
            TrainingSample(b.token_ids, b.sampled_mask, b.logprobs, agent) for b in trace.branches if b.trainable
        )
        made_samples = [sample for sample in trainable if sample.token_ids]  # a branch without a token is none
        split += len(made_samples) > 1
        for sample in made_samples:
            samples.append(sample)
            segments += span_versions(sample, own)
    if not samples:
        raise VerifiersEpisodeError(
            f"the episode yielded no sample: its {len(traces)} trainable traces have no trainable branch"
        )
    rewards = {agent: trace.reward for trace, agent in zip(traces, labels)}
    policy_start, policy_end, exact = episode_versions(req, segments, records)
    trained = {sample.agent for sample in samples}
    try:
        done = episode_of_samples(
            req,
            samples if several_agents else [sample._replace(agent=None) for sample in samples],
            reward=sum(rewards.values()) / len(rewards),  # every trainable agent's, trained or not
            policy_start=policy_start,
            policy_end=policy_end,
            temperature=temperature,
            version_segments=exact,
            agent_rewards={a: r for a, r in rewards.items() if a in trained} if several_agents else None,
        )
    except ValueError as err:
        raise VerifiersEpisodeError(f"its samples do not make an episode: {err}") from None
    tally.count(len(samples), split, several_agents, records)
    return done


def episode_versions(
    req: RolloutRequest, segments: list[tuple[int, int] | None], records: list[adapter.CallRecord]
) -> tuple[int, int, list[tuple[int, int]]]:
    """(policy_start, policy_end, version segments) of an episode: where every sampled span's
    version is known, the oldest and newest of them and the segments (the log then says each
    token's); else the bounds of every call's versions and no segments."""
    if segments and None not in segments:
        known = [segment for segment in segments if segment is not None]
        return min(v for v, _ in known), max(v for v, _ in known), known
    versions = [(c.policy_start, c.policy_end) for c in records] or [(req.policy_version,) * 2]
    return min(v[0] for v in versions), max(v[1] for v in versions), []


def agent_labels(traces) -> list[str]:
    """Each trainable trace's agent, as its samples name it: the agent's seat name, or where
    one seat played several traces of the episode (best-of-n), `name#k` for its k-th trace in
    the episode's order; the core scores a seat's traces in one pool (`core.samples.seat_of`;
    docs/verifiers.md, "Several agents")."""
    names = [trace.agent.name if trace.agent is not None else "agent" for trace in traces]
    played, seen = Counter(names), Counter[str]()
    labels = []
    for name in names:
        seen[name] += 1
        labels.append(name if played[name] == 1 else f"{name}#{seen[name]}")
    return labels


def span_versions(sample: TrainingSample, records: list[adapter.CallRecord]) -> list[tuple[int, int] | None]:
    """The version of each sampled span of `sample` (a run of mask 1): that of the model call
    which was sent the tokens before it and answered its tokens (None where no recorded call
    did, or where the call's version is only bounded: the backend could not tell it exactly)."""
    tokens, found = list(sample.token_ids), []
    for start, end in sampled_spans(sample.mask):
        prompt, answer = adapter.prompt_key(tokens[:start]), tokens[start:end]
        call = next((c for c in records if c.prompt == prompt and answer_ids(c.answer) == answer), None)
        exact = call is not None and call.policy_start == call.policy_end
        found.append((call.policy_start, end - start) if exact else None)
    return found


def sampled_spans(mask) -> list[tuple[int, int]]:
    """[start, end) of each run of sampled tokens."""
    spans, start = [], 0
    for sampled, run in itertools.groupby(mask, key=bool):
        end = start + sum(1 for _ in run)
        if sampled:
            spans.append((start, end))
        start = end
    return spans


def answer_ids(answer: dict) -> list[int] | None:
    choices = answer.get("choices") or [{}]
    return choices[0].get("token_ids")


def _first_error(episode) -> str:
    errors = list(episode.errors) + [e for t in episode.traces for e in t.errors]
    if not errors:
        return "the episode failed without an error"
    err = errors[0]
    lines = [line for line in (err.message or "").strip().splitlines() if line.strip()]
    return f"{err.type}: {lines[-1] if lines else ''}"[:500]
