"""The `verifiers` env as the `openai` backend calls it: one verifiers `run_slot` per orch episode.

Tasks: the group's ``task_id`` (the env's cursor, in `group_dispatched`) picks a task of the
taskset deterministically from the run's seed (:func:`task_index`), so a resumed or replayed run
sees the same tasks. An episode: verifiers' `Env.run_slot` on that task, its model calls routed
through the backend's inference client (:mod:`.adapter`): the group pinned to one endpoint,
retries on another, each call's weight version recorded. Its sample: the trainable trace's last
trainable branch (token ids, sampled mask and logprobs exactly as vLLM saw and returned them)
with the trace's reward; `policy_start`/`policy_end` are the oldest and newest versions its calls
were sampled with. docs/verifiers.md says why one branch, and how a multi-branch episode counts.

Cancellation (drain, stop, a stale group): the rollout's task is cancelled, which ends its harness
subprocess (verifiers kills its process group) and drops its model call in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrator.contracts import ModelCalls, RolloutRequest
from orchestrator.core.events import EpisodeCompleted
from orchestrator.verifiers import adapter
from orchestrator.verifiers.config import VerifiersSettings, load_env


class VerifiersEpisodeError(RuntimeError):
    """A verifiers episode that did not yield a sample; the message says why (an episode failure)."""


def task_index(seed: int, cursor: int, size: int | None) -> int:
    """The taskset position of the env's `cursor`-th task: each pass over a finite taskset is a
    fresh seeded permutation of it; an infinite one is read in order."""
    if size is None:
        return cursor
    order = list(range(size))
    random.Random(f"verifiers/{seed}/{cursor // size}").shuffle(order)
    return order[cursor % size]


@dataclass
class Tally:
    """What the run should know about its episodes beside the log."""

    episodes: int = 0
    split: int = 0  # episodes whose trace split into several branches
    untrained_tokens: int = 0  # sampled tokens on the branches a split left out of the sample
    harness_s: float = 0.0  # wall time inside run_slot (verifiers: harness, model calls, scoring)
    orch_s: float = 0.0  # the rest of each episode (task draw, conversion)
    calls: int = 0
    route_s: float = 0.0  # orch's routing of the model calls, beyond their HTTP exchange (inside harness_s)


def uv_on_path() -> None:
    """verifiers' subprocess runtime runs `uv` from PATH (without one, it pip-installs one into
    ~/.local/bin from the network): the `uv` package's, installed beside orch, is put on it."""
    from uv import find_uv_bin

    bin_dir = str(Path(find_uv_bin()).parent)
    path = os.environ.get("PATH", "")
    if bin_dir not in path.split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + path


class VerifiersEnv:
    """An ``orchestrator.envs.base.AgentEnv``: ``await env.episode(request, client)`` plays one
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
        self._finite = taskset.bounded
        self._tasks: list = list(taskset) if self._finite else []  # an infinite one: read as far as drawn
        self._stream = None if self._finite else iter(taskset)
        self.route: adapter.GenerateRoute | None = None  # bound to the backend's client by the first episode
        self._context: Any = None
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

    def task(self, cursor: int):
        index = task_index(self.seed, cursor, len(self._tasks) if self._finite else None)
        if self._stream is not None:
            while len(self._tasks) <= index:
                self._tasks.append(next(self._stream))
        return self._tasks[index]

    def _bind(self, client: ModelCalls) -> tuple[adapter.GenerateRoute, Any]:
        """The route of the run's model calls through `client`, and the verifiers ModelContext on it."""
        if self.route is None:
            import verifiers.v1 as vf

            self.route = adapter.GenerateRoute(client)
            self._context = vf.ModelContext(
                model=self.model,
                client=adapter.client_config(self.route, self.renderer_model, self.section.renderer),
                sampling=vf.SamplingConfig(temperature=self.temperature, max_tokens=self.max_tokens),
            )
        elif self.route.client is not client:
            raise RuntimeError("a verifiers env samples through one inference client per run")
        return self.route, self._context

    async def episode(self, req: RolloutRequest, client: ModelCalls) -> EpisodeCompleted:
        route, context = self._bind(client)
        loop = asyncio.get_running_loop()
        began = loop.time()
        (slot,) = self.env.slots(self.task(req.task_id), 1)
        sessions: list[str] = []

        def minted(trace) -> None:  # verifiers mints a trace before its first model call
            sessions.append(trace.id)
            route.open(trace.id, pin=req.group_id)

        sampled_at = loop.time()
        try:
            episode = await self.env.run_slot(slot, context, on_trace=minted)
        finally:  # cancelled too (drain, stop): its calls are forgotten with it
            calls = {session: route.close(session) for session in sessions}
        harness_s = loop.time() - sampled_at
        completed = self._completion(req, episode, calls)
        self.tally.harness_s += harness_s
        self.tally.orch_s += loop.time() - began - harness_s
        return completed

    def _completion(self, req: RolloutRequest, episode, calls: dict) -> EpisodeCompleted:
        if not episode.ok:
            raise VerifiersEpisodeError(_first_error(episode))
        traces = [t for t in episode.traces if t.agent is None or t.agent.trainable]
        if len(traces) != 1:
            raise VerifiersEpisodeError(f"the episode has {len(traces)} trainable traces; orch trains one per episode")
        (trace,) = traces
        branches = [b for b in trace.branches if b.trainable]
        if not branches:
            raise VerifiersEpisodeError("the episode's trace has no trainable branch")
        branch = branches[-1]  # the whole conversation; docs/verifiers.md: multi-branch episodes
        made = calls.get(trace.id)
        records = made.calls if made is not None else []
        t = self.tally
        t.episodes += 1
        t.calls += len(records)
        t.route_s += sum(c.route_s - c.http_s for c in records)
        if len(branches) > 1:
            t.split += 1
            t.untrained_tokens += sum(sum(b.sampled_mask) for b in branches[:-1])
        versions = [(c.policy_start, c.policy_end) for c in records] or [(req.policy_version,) * 2]
        return EpisodeCompleted(
            episode_id=req.episode_id,
            group_id=req.group_id,
            ok=True,
            reward=trace.reward,
            token_ids=branch.token_ids,
            mask=bytes(branch.sampled_mask),  # packed at once: a byte of 0/1 per token
            logprobs=branch.logprobs,
            policy_start=min(v[0] for v in versions),
            policy_end=max(v[1] for v in versions),
            temperature=self.temperature,
        )

    def report(self) -> str:
        t = self.tally

        def per(seconds: float) -> str:
            return f"{1000 * seconds / t.episodes:.1f} ms" if t.episodes else "-"

        return (
            f"orch: verifiers: {t.episodes} episodes, {t.split} split into several branches "
            f"({t.untrained_tokens} sampled tokens left out of their samples); per episode: verifiers "
            f"{per(t.harness_s)} (orch's routing of its {t.calls} model calls: {per(t.route_s)}), orch "
            f"{per(t.orch_s)}"
        )


def _first_error(episode) -> str:
    errors = list(episode.errors) + [e for t in episode.traces for e in t.errors]
    if not errors:
        return "the episode failed without an error"
    err = errors[0]
    lines = [line for line in (err.message or "").strip().splitlines() if line.strip()]
    return f"{err.type}: {lines[-1] if lines else ''}"[:500]
