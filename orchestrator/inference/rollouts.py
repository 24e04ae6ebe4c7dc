"""`InferenceRollouts`: reverse_text episodes sampled by OpenAI-compatible endpoints.

The same interface as ``orchestrator.shell.rollouts.EmbeddedRollouts`` (``await backend(req)`` ->
``EpisodeCompleted``; ``await backend.load(version, health_check)``), but the sampling happens in
other processes (`orch serve`, vLLM, SGLang) through :class:`~.client.InferenceClient`.

An episode: the env's task -> its prompt rendered with the embedded tokenizer (the trainer's
vocabulary) and sent as token ids -> one completion (seeded by run seed, episode and attempt; the
group id pins the group to one endpoint) -> scored by the env -> ``EpisodeCompleted`` with the
prompt + completion ids, mask, per-token logprobs and the version the endpoint reports. A request
whose endpoint fails is re-sent to another endpoint (same episode, same seed); when the client
gives up, the exception becomes an errored episode (ok=False) in the loop.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path

from orchestrator.core.events import EpisodeCompleted
from orchestrator.rundir import is_stable, weights_dir
from orchestrator.embedded.tokenizer import encode_prompt
from orchestrator.inference.client import InferenceClient, InferenceError, InferenceRequestError
from orchestrator.shell.loop import warn


class InferenceRollouts:
    def __init__(self, run_dir: str | os.PathLike, env, client: InferenceClient, *, temperature: float,
                 max_new_tokens: int, seed: int, load_timeout_s: float):
        self.run_dir, self.env, self.client, self.seed = Path(run_dir).resolve(), env, client, seed
        self.temperature, self.max_new_tokens, self.load_timeout_s = temperature, max_new_tokens, load_timeout_s
        self._loaded = asyncio.Event()
        self.version = -1  # newest version confirmed by at least one endpoint

    async def load(self, version: int, health_check: Callable[[], None] | None = None) -> None:
        """Wait (bounded) for ``weights/step_{version}/STABLE``, then have every endpoint load it;
        returns once the endpoints answered (at least one confirmation, else it retries until
        ``load_timeout_s``: endpoints may still be starting). Loads of successive versions may
        overlap: an endpoint slow to answer one load does not hold the others back."""
        wdir = weights_dir(self.run_dir, version)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.load_timeout_s
        if self.version >= version:
            return
        while not is_stable(wdir):
            if health_check is not None:
                health_check()
            if loop.time() > deadline:
                raise TimeoutError(f"waited {self.load_timeout_s:.0f}s for the trainer to publish {wdir}")
            await asyncio.sleep(0.05)
        pause, warned = self.client.backoff_s, False
        while True:
            try:
                await self.client.load(version, str(wdir))
                break
            except InferenceRequestError:
                raise
            except InferenceError as err:
                if health_check is not None:
                    health_check()
                if loop.time() > deadline:
                    raise
                if not warned:  # the first failure: say what the run waits for
                    warned = True
                    warn(f"{err}; retrying for up to {deadline - loop.time():.0f}s more (endpoints may be starting)")
                # Endpoints still starting up: probe again with backoff, as requests do.
                await asyncio.sleep(min(pause, max(0.0, deadline - loop.time())))
                pause = min(2 * pause, self.client.max_backoff_s)
        self.version = max(self.version, version)
        self._loaded.set()

    async def __call__(self, req) -> EpisodeCompleted:
        await asyncio.wait_for(self._loaded.wait(), self.load_timeout_s)
        task = await self.env.task(req.task_id)
        prompt_ids = encode_prompt(task.prompt)
        seed = ((self.seed << 32) ^ (req.episode_id << 4) ^ req.attempt) & 0x7FFF_FFFF_FFFF_FFFF
        # An eval episode (req.eval_id) goes the same way at its own temperature, asking for its
        # pinned version (which only vllm_lora adapters can give); the completion reports the
        # version that sampled it, and the core counts one taken by another version than its
        # eval's apart from the eval's figures (docs/evals.md).
        temperature = self.temperature if req.temperature is None else req.temperature
        done = await self.client.complete(prompt_ids, n=1, temperature=temperature, max_tokens=self.max_new_tokens,
                                          seed=seed, pin=req.group_id,
                                          at_version=None if req.eval_id is None else req.policy_version)
        (choice,) = done.choices
        if choice.prompt_ids is not None and list(choice.prompt_ids) != prompt_ids:
            raise InferenceRequestError(f"{done.endpoint} sampled from prompt {choice.prompt_ids}, not {prompt_ids}")
        return EpisodeCompleted(
            episode_id=req.episode_id, group_id=req.group_id, ok=True,
            reward=await self.env.score(task, choice.text), token_ids=prompt_ids + choice.token_ids,
            mask=[0] * len(prompt_ids) + [1] * len(choice.token_ids),
            logprobs=[0.0] * len(prompt_ids) + choice.logprobs,
            policy_start=done.policy_start, policy_end=done.policy_end, temperature=temperature,
        )

    def report(self) -> str:
        return "orch: inference: " + self.client.report()

    async def aclose(self) -> None:
        await self.client.aclose()
