"""reverse_text: reverse a short random string; answer inside <reversed_text>...</reversed_text>.

Held-out split (docs/evals.md): eval tasks are the negative indices (the train cursor starts at 0
and only moves up) and, by content, the prompts of `is_held_out`: a train task never has one, an
eval task always has one, whatever the seed. So no held-out prompt is ever trained on.
Success notion (pass@k): a reward of 1.0, the exact reversal inside the tags.
"""

from __future__ import annotations

import asyncio
import difflib
import random
import re
import zlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, ClassVar

from pydantic import Field, field_validator

from orchestrator.contracts import BuildContext, ConfigError, EnvComponent, InProcessEnv, RolloutEnv, RunPlan, Task
from orchestrator.notices import warn_connection_cap
from orchestrator.urls import check_http_url

if TYPE_CHECKING:
    from orchestrator.envs.client import HttpEnvClient

OPEN_TAG = "<reversed_text>"
CLOSE_TAG = "</reversed_text>"
ALPHABET = "abcdefgh"
_ANSWER = re.compile(re.escape(OPEN_TAG) + r"(.*?)" + re.escape(CLOSE_TAG), re.DOTALL)
HELD_OUT_EVERY = 8  # one prompt in this many (by content) is held out for evals
MAX_DRAWS = 1000  # draws per task before the lengths are judged to leave one side of the split empty
PREFLIGHT_TIMEOUT_S = 10.0  # the bound on the env server's check before the run


def is_held_out(prompt: str) -> bool:
    """Is `prompt` on the held-out side of the split? A fixed function of its content."""
    return zlib.crc32(prompt.encode()) % HELD_OUT_EVERY == 0


def solved(reward: float) -> bool:
    """reverse_text's success notion: the exact reversal."""
    return reward == 1.0


def extract_answer(completion: str) -> str | None:
    """The text inside the first pair of tags, or None if the tags are missing."""
    match = _ANSWER.search(completion)
    return match.group(1) if match else None


def reversal_reward(completion: str, prompt: str) -> float:
    answer = extract_answer(completion)
    if answer is None:
        return 0.0
    return difflib.SequenceMatcher(None, answer, prompt[::-1]).ratio()


class ReverseTextEnv:
    name = "reverse_text"

    def __init__(self, seed: int = 0, min_len: int = 3, max_len: int = 6, alphabet: str = ALPHABET):
        if not 1 <= min_len <= max_len:
            raise ValueError(f"reverse_text: need 1 <= min_len <= max_len, got {min_len}, {max_len}")
        self.seed, self.min_len, self.max_len, self.alphabet = seed, min_len, max_len, alphabet

    @property
    def params(self) -> dict[str, int]:
        """What its tasks are a function of (besides the index): an env server reports it, so a
        run can check that the server's tasks are the ones it asks for."""
        return {"seed": self.seed, "min_len": self.min_len, "max_len": self.max_len}

    def task(self, index: int) -> Task:
        """Train tasks at index >= 0, held-out (eval) tasks at index < 0: each drawn until its
        prompt is on its side of the split."""
        # A private RNG per task: tasks depend only on (seed, index), never on call order.
        rng = random.Random(f"reverse_text/{self.seed}/{index}")
        held_out = index < 0
        for _ in range(MAX_DRAWS):
            length = rng.randint(self.min_len, self.max_len)
            prompt = "".join(rng.choice(self.alphabet) for _ in range(length))
            if is_held_out(prompt) == held_out:
                return Task(
                    env=self.name,
                    index=index,
                    prompt=prompt,
                    answer=OPEN_TAG + prompt[::-1] + CLOSE_TAG,
                    messages=[{"role": "user", "content": prompt}],
                )
        side = "held-out" if held_out else "train"
        raise ValueError(
            f"reverse_text: prompts of {self.min_len}..{self.max_len} letters from {self.alphabet!r} "
            f"leave (next to) no {side} prompt; allow longer prompts"
        )

    def score(self, task: Task, completion: str) -> float:
        return reversal_reward(completion, task.prompt)


class ReverseTextConfig(EnvComponent):
    """reverse_text tasks: in this process, or behind the `orch env-server` at `env.reverse_text.server`."""

    gives_messages: ClassVar[bool] = True
    resumable: ClassVar[frozenset[str]] = frozenset({"server", "max_connections"})

    min_len: int = Field(3, ge=1, description="shortest string to reverse, in characters")
    max_len: int = Field(6, ge=1, description="longest string to reverse, in characters")
    server: str | list[str] | None = Field(
        None,
        description="URL of an `orch env-server` serving these tasks, or a list of several (a pool: each call "
        "to the least busy, a failed one set aside and probed again); else the env runs in-process",
    )
    max_connections: int | None = Field(
        None,
        ge=1,
        description="HTTP connections to the env server (to each of a pool), at most (None: no cap, one per "
        "episode in flight); "
        "a call beyond it waits for a free one",
    )

    @field_validator("server")
    @classmethod
    def _server_is_a_url(cls, server: str | list[str] | None) -> str | list[str] | None:
        for url in [server] if isinstance(server, str) else server or []:
            check_http_url(url, f"server {url!r}")
        if isinstance(server, list) and not server:
            raise ValueError("server: an empty list (give one URL or several, or none: in-process)")
        return server

    def servers(self) -> list[str]:
        """The env servers' URLs (none: in-process)."""
        return [self.server] if isinstance(self.server, str) else list(self.server or [])

    def check(self, plan: RunPlan) -> None:
        if self.server is not None and plan.eval_envs:
            raise ValueError(
                "evals need held-out tasks (negative indices), which env.reverse_text.server does not serve; "
                "run the env in-process for evals"
            )
        warn_connection_cap(
            self.max_connections if self.server is not None else None,  # in-process: no connection
            plan.requests_in_flight,
            "env.reverse_text.max_connections allows {cap} connection(s) to the env server, "
            "fewer than the {needed} episodes the run keeps in flight (rollout.max_inflight): "
            "the others wait for a free one",
        )

    def solved(self, reward: float) -> bool:
        return solved(reward)

    def text_env(self, seed: int) -> ReverseTextEnv:
        return ReverseTextEnv(seed=seed, min_len=self.min_len, max_len=self.max_len)

    def preflight(self, seed: int) -> None:
        """Its server (if given) reachable and serving this run's tasks, before the run dir exists."""
        if not self.servers():
            return
        from orchestrator.envs.client import EnvServerError, HttpEnvClient  # httpx: only now

        async def check() -> None:
            for server in self.servers():  # each member of a pool serves this run's tasks
                async with HttpEnvClient(server, timeout=PREFLIGHT_TIMEOUT_S) as client:
                    await self._check_server(client, seed)

        try:
            asyncio.run(check())
        except EnvServerError as err:
            raise ConfigError(f"env.reverse_text.server: {err}") from None

    @asynccontextmanager
    async def open(self, ctx: BuildContext) -> AsyncIterator[RolloutEnv]:
        if self.server is None:
            yield InProcessEnv(self.text_env(ctx.seed))
            return
        from orchestrator.envs.client import EnvServerPool, HttpEnvClient  # httpx: only now

        servers = self.servers()
        if len(servers) == 1:
            async with HttpEnvClient(servers[0], max_connections=self.max_connections) as client:
                await self._check_server(client, ctx.seed)
                yield client
            return
        async with EnvServerPool(servers, max_connections=self.max_connections) as pool:
            for client in pool.clients:
                await self._check_server(client, ctx.seed)
            yield pool

    async def _check_server(self, client: HttpEnvClient, seed: int) -> None:
        """Fail before the run, in one line, if the env server is unreachable or does not serve the
        tasks this run asks for (reverse_text, with the run's seed and prompt lengths)."""
        from orchestrator.envs.client import EnvServerError

        health = await client.health()
        served = health.get("env") if isinstance(health, dict) else None
        if served != ReverseTextEnv.name:
            raise EnvServerError(f"{client.base_url} serves env {served!r}, not 'reverse_text'")
        wanted = {"seed": seed, "min_len": self.min_len, "max_len": self.max_len}
        if health.get("params") != wanted:
            raise EnvServerError(
                f"{client.base_url} serves reverse_text tasks of {health.get('params')}, this run's "
                f"are {wanted}: start it with --seed {seed} --min-len {wanted['min_len']} "
                f"--max-len {wanted['max_len']}"
            )
