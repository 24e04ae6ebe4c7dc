"""`EndpointsBackend`: episodes sampled by OpenAI-compatible endpoints (inference backend `openai`).

An ``orchestrator.contracts.InferenceBackend`` like the embedded one, but the sampling happens
in other processes (`orch serve`, vLLM, SGLang; given, or started by the run:
``inference.openai.launch``) through :class:`~.client.InferenceClient`.

An episode: the env's task -> its prompt rendered as token ids with the run's model dir's tokenizer
(its chat messages through the chat template with ``model.chat_template_kwargs``, as the trainer
sees them; `orch serve`'s embedded policy, driven directly: its own char tokenizer) and sent as
token ids -> one completion (seeded by run seed, episode and attempt; the
group id pins the group to one endpoint) -> scored by the env -> ``EpisodeCompleted`` with the
prompt + completion ids, mask, per-token logprobs and the version the endpoint reports. A request
whose endpoint fails is re-sent to another endpoint (same episode, same seed); when the client
gives up, the episode fails like any other (the core counts and drops it).

An env that plays its episodes itself (``orchestrator.contracts.AgentEnv``: a verifiers taskset)
gets the request and this client instead: its model calls take the same routing, retries and
weight versions, and the backend still launches the servers and loads each version.
"""

from __future__ import annotations

import asyncio
import os
from collections import OrderedDict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import orjson

from orchestrator.contracts import (
    AgentEnv,
    BuildContext,
    ConfigError,
    RolloutEnv,
    RolloutRequest,
    Task,
    sampled_episode,
)
from orchestrator.core.events import EpisodeCompleted
from orchestrator.inference.client import InferenceClient, InferenceError, InferenceRequestError
from orchestrator.inference.endpoints_config import EndpointsSettings
from orchestrator.notices import report, warn
from orchestrator.rundir import is_stable, weights_dir
from orchestrator.urls import endpoint_base_urls

if TYPE_CHECKING:
    from orchestrator.inference.vllm_launch import VllmLauncher

RENDERED_PROMPTS = 4096  # prompts kept rendered: the tasks of the groups in flight


def build_endpoints_backend(
    section: EndpointsSettings, ctx: BuildContext, envs: Mapping[str, RolloutEnv | AgentEnv]
) -> EndpointsBackend:
    """The `openai` backend of a run on its prepared model (``ctx.model``: the endpoints serve it):
    the client of its endpoints (given, or the vLLM servers of ``inference.openai.launch``, started
    at the backend's first load)."""
    if ctx.model is None:
        raise ValueError("inference endpoints need the run's prepared model (the hf trainer's)")
    model_dir = ctx.model.path.resolve()
    launcher, urls = None, section.endpoints
    if section.launch.servers:
        from orchestrator.inference.vllm_launch import VllmLauncher

        launcher = VllmLauncher(
            section.launch,
            model_dir,
            ctx.run_dir,
            section.weight_sync,
            section.max_loras,
            ctx.placement,
            section.update_mode_in_use,
        )
        urls = launcher.urls
    return EndpointsBackend(
        ctx.run_dir,
        envs,
        make_client(section, urls, ctx.publish_timeout_s),
        temperature=ctx.sampling.temperature,
        max_new_tokens=ctx.sampling.max_new_tokens,
        seed=ctx.seed,
        load_timeout_s=ctx.publish_timeout_s,
        model_dir=model_dir,
        launcher=launcher,
        chat_template_kwargs=ctx.sampling.chat_template_kwargs,
    )


def make_client(section: EndpointsSettings, urls: list[str], load_timeout_s: float) -> InferenceClient:
    return InferenceClient(
        urls,
        model=section.model,
        weight_sync=section.weight_sync,
        timeout_s=section.request_timeout_s,
        load_timeout_s=load_timeout_s,
        max_attempts=section.max_attempts,
        backoff_s=section.backoff_s,
        max_backoff_s=section.max_backoff_s,
        pin_groups=section.pin_groups,
        max_loras=section.max_loras,
        update_mode=section.update_mode_in_use,
        max_connections=section.max_connections,
        max_connections_per_endpoint=section.max_connections_per_endpoint,
        stream_interval=section.stream_interval,
        routers=section.routers,
    )


def check_given_endpoints(section: EndpointsSettings, weight_format: str | None) -> None:
    """The backend's first pre-run step (`OpenAIConfig.preflight_servers`, before the model is
    built): ConfigError (one line) for a given endpoint that is unreachable, failing, or cannot
    load the trainer's `weight_format` (`orchestrator.inference.preflight`)."""
    if (section.endpoints or section.routers) and section.preflight_timeout_s > 0:
        from orchestrator.inference.preflight import PreflightError, check_endpoints

        # a router is checked as it serves (/v1/models, /health), its engines as they load weights
        given = section.endpoints + [url for router in section.routers for url in (router.url, *router.engines)]
        urls = list(dict.fromkeys(endpoint_base_urls(given)))
        try:
            asyncio.run(check_endpoints(urls, section.weight_sync, section.preflight_timeout_s, weight_format))
        except PreflightError as err:
            raise ConfigError(str(err)) from None


def check_inference(section: EndpointsSettings, model_dir: Path) -> None:
    """The backend's pre-run step once the model is prepared (`OpenAIConfig.preflight`, before
    the run dir exists; the model dir itself is checked by ``orchestrator.hf.model``): ConfigError
    (one line) for a launch that cannot work (`check_launch`), or a given vLLM endpoint that serves
    another model or lacks the routes of the weight sync. (What needs no file nor server is checked
    with the config: `OpenAIConfig.check`; the endpoints' reachability before the model is
    built: `check_given_endpoints`.)"""
    from orchestrator.inference.vllm_launch import check_launch
    from orchestrator.inference.weight_sync.vllm_check import check_vllm_endpoints

    check_launch(section.launch, model_dir, section.dialect)
    if (section.endpoints or section.routers) and section.dialect.engine == "vllm":

        async def check() -> None:
            # the check loads no weights: its client's load bound is the request timeout
            async with make_client(section, section.endpoints, section.request_timeout_s) as client:
                await check_vllm_endpoints(client, model_dir)

        try:
            asyncio.run(check())
        except InferenceRequestError as err:
            raise ConfigError(str(err)) from None


def prompt_renderer(model_dir: Path, chat_template_kwargs: Mapping | None = None) -> Callable[[Task], list[int]]:
    """task -> prompt token ids, with the model dir's tokenizer (`orchestrator.hf.model`)."""
    from orchestrator.hf.model import load_tokenizer, render_prompt

    tokenizer, kwargs = load_tokenizer(model_dir), dict(chat_template_kwargs or {})
    rendered: OrderedDict[bytes, list[int]] = OrderedDict()

    def render(task) -> list[int]:
        # A group's episodes share their task: its chat template is rendered once, not per member.
        try:
            key = orjson.dumps((task.prompt, task.messages))
        except TypeError:  # messages holding other than JSON values: rendered each time
            return render_prompt(tokenizer, task.prompt, task.messages, **kwargs)
        ids = rendered.get(key)
        if ids is None:
            ids = rendered[key] = render_prompt(tokenizer, task.prompt, task.messages, **kwargs)
            if len(rendered) > RENDERED_PROMPTS:
                rendered.popitem(last=False)
        else:
            rendered.move_to_end(key)
        return list(ids)

    return render


def episode_seed(run_seed: int, episode_id: int, attempt: int) -> int:
    """The sampling seed of an episode's attempt: the same on every endpoint it is sent to."""
    return ((run_seed << 32) ^ (episode_id << 4) ^ attempt) & 0x7FFF_FFFF_FFFF_FFFF


class EndpointsBackend:
    follows_weights: ClassVar[bool] = True

    def __init__(
        self,
        run_dir: str | os.PathLike,
        envs: Mapping[str, RolloutEnv | AgentEnv],
        client: InferenceClient,
        *,
        temperature: float,
        max_new_tokens: int,
        seed: int,
        load_timeout_s: float,
        model_dir: Path | None = None,
        launcher: VllmLauncher | None = None,
        chat_template_kwargs: Mapping | None = None,
        encode_prompt: Callable[[Task], list[int]] | None = None,
    ):
        """`encode_prompt`: how a task's prompt becomes token ids, if not with `model_dir`'s
        tokenizer (`orch serve`'s char-level policy: `orchestrator.serve.tokenizer.task_prompt_ids`);
        neither: the envs play their episodes themselves (`AgentEnv`)."""
        self.run_dir, self.envs, self.client, self.seed = Path(run_dir).resolve(), envs, client, seed
        self.temperature, self.max_new_tokens, self.load_timeout_s = temperature, max_new_tokens, load_timeout_s
        self.model_dir, self.launcher = model_dir, launcher
        if encode_prompt is None and model_dir is not None:
            encode_prompt = prompt_renderer(model_dir, chat_template_kwargs)
        self.encode_prompt = encode_prompt
        self._loaded = asyncio.Event()
        self._agent_envs: dict[str, bool] = {}
        self._ready = launcher is None  # launched servers: once they answered /health
        self._servers_ready = asyncio.Event()
        self.version = -1  # newest version confirmed by at least one endpoint

    async def load(self, version: int, health_check: Callable[[], None] | None = None) -> None:
        """Wait (bounded) for ``weights/step_{version}/STABLE``, then have every endpoint load it;
        returns once the endpoints answered (at least one confirmation, else it retries until
        ``load_timeout_s``: endpoints may still be starting). Loads of successive versions may
        overlap: an endpoint slow to answer one load does not hold the others back. The first
        load starts the launched servers and waits for them (their own bound: ``ready_timeout_s``)."""
        if not self._ready:
            if not self.launcher.started:
                self.launcher.start()
            await self.launcher.wait_ready(health_check)
            self._ready = True
            self._servers_ready.set()
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

    async def __call__(self, req: RolloutRequest) -> EpisodeCompleted:
        if not self._loaded.is_set():
            await asyncio.wait_for(self._loaded.wait(), self.load_timeout_s)
        env = self.envs[req.env]
        if self._plays_itself(req.env):  # it plays the episode, its model calls through this client
            return await env.episode(req, self.client)
        if self.encode_prompt is None:
            raise ValueError(f"env {req.env!r} gives prompts, and this backend has no model dir to render them with")
        task = await env.task(req.task_id)
        prompt_ids = self.encode_prompt(task)
        seed = episode_seed(self.seed, req.episode_id, req.attempt)
        # An eval episode (req.eval_id) goes the same way at its own temperature, asking for its
        # pinned version (which only vllm_lora adapters can give); the completion reports the
        # version that sampled it, and the core counts one taken by another version than its
        # eval's apart from the eval's figures (docs/evals.md).
        temperature = self.temperature if req.temperature is None else req.temperature
        done = await self.client.complete(
            prompt_ids,
            n=1,
            temperature=temperature,
            max_tokens=self.max_new_tokens,
            seed=seed,
            pin=req.group_id,
            at_version=None if req.eval_id is None else req.policy_version,
        )
        (choice,) = done.choices
        policy_start, policy_end = done.choice_policy(0)
        if choice.prompt_ids is not None and choice.prompt_ids != prompt_ids:
            raise InferenceRequestError(f"{done.endpoint} sampled from prompt {choice.prompt_ids}, not {prompt_ids}")
        return sampled_episode(
            req,
            prompt_ids=prompt_ids,
            completion_ids=choice.token_ids,
            completion_logprobs=choice.logprobs,
            reward=await env.score(task, choice.text),
            policy_start=policy_start,
            policy_end=policy_end,
            token_versions=done.choice_versions[0] if done.choice_versions else (),
            temperature=temperature,
        )

    async def watch(self, report_endpoint_change: Callable[[str, bool, int, str], None]) -> None:
        """For the whole run, once they are ready: the servers it launched, restarted when they
        die or freeze (`VllmLauncher.watch`). Without launched servers, nothing to watch."""
        if self.launcher is None:
            return
        await self._servers_ready.wait()
        await self.launcher.watch(self.client, report_endpoint_change)

    def _plays_itself(self, name: str) -> bool:
        # Asked once per env: isinstance of a runtime-checkable Protocol walks its members each time.
        plays = self._agent_envs.get(name)
        if plays is None:
            plays = self._agent_envs[name] = isinstance(self.envs[name], AgentEnv)
        return plays

    async def aclose(self) -> None:
        """Report how each endpoint fared, then close the HTTP client and stop launched servers."""
        report("orch: inference: " + self.client.report())
        try:
            await self.client.aclose()
        finally:
            if self.launcher is not None:
                self.launcher.stop()
