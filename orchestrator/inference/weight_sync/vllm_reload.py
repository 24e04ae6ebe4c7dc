"""`vllm_reload`: a vLLM server's full-weight reload (``VLLM_SERVER_DEV_MODE=1``): ``POST
/pause?mode=wait`` (update_mode interrupt: ``mode=abort``; keep: ``mode=keep``) -> ``POST
/collective_rpc {"method": "reload_weights", ...}`` (keep: -> ``POST /update_weight_version``) ->
``POST /reset_prefix_cache`` (keep: ``?reset_running_requests=true``) -> ``POST /resume``. No
request of an endpoint is sent while it reloads, so a completion's version is the one it was sent
at; in keep, the requests frozen by the pause go on with the new weights, and the engine reports
which version sampled each token."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from orchestrator.inference.errors import Retryable
from orchestrator.inference.weight_sync.base import (
    EndpointT,
    RouteProbe,
    WeightSyncClient,
    WeightSyncDialect,
    check_weights_dir,
    on_each_engine,
    versions_held,
)

# vLLM's /pause mode for each update_mode: wait drains first; interrupt aborts the running requests
# (the client continues them); keep freezes them (the engine continues them).
PAUSE_MODES = {"wait": "wait", "interrupt": "abort", "keep": "keep"}


@dataclass
class ReloadState:
    reloading: asyncio.Event | None = None  # set (and dropped) once the reload running is done


class VllmReload(WeightSyncDialect):
    engine = "vllm"
    summary = "vLLM full reload (/pause, reload_weights, /reset_prefix_cache, /resume)"
    update_modes = frozenset({"wait", "interrupt", "keep"})
    default_update_mode = "interrupt"  # it samples more tokens/s through a long tail
    route_probe = RouteProbe("GET", "/is_paused", needs="VLLM_SERVER_DEV_MODE=1")

    def launch_env(self) -> dict[str, str]:
        """The dev-mode routes: /pause, /collective_rpc, /reset_prefix_cache."""
        return {"VLLM_SERVER_DEV_MODE": "1"}

    def new_state(self) -> ReloadState:
        return ReloadState()

    async def load(self, client: WeightSyncClient[EndpointT], ep: EndpointT, version: int, path: str) -> int:
        """vLLM full-weight reload (VLLM_SERVER_DEV_MODE=1); none of the endpoint's requests is
        sent until it resumed. update_mode wait: its requests in flight end with the old weights
        first. interrupt: the streamed completions without a first token yet are ended and sent
        again after the reload (`Endpoint.restart_unstarted`); once the calls of other routes
        have ended (`Endpoint.abortable`), the pause aborts the rest: each comes back with the
        tokens it has, all sampled by the old weights, and the client continues it after the
        reload. keep: once the calls of other routes have ended, the pause freezes the running
        requests, and the prefix-cache reset sends them back to the queue, so that the new
        weights compute their KV again before they go on; the engine says which version sampled
        each token. Either way each token's version is exact."""
        state: ReloadState = ep.sync
        async with versions_held(path, client.load_timeout_s):
            check_weights_dir(path, "config.json", "an HF model dir")  # a failed reload kills vLLM's engine
            state.reloading = asyncio.Event()
            mode = client.update_mode
            try:
                if mode == "interrupt":
                    ep.restart_unstarted()
                try:
                    await asyncio.wait_for((ep.idle if mode == "wait" else ep.abortable).wait(), client.load_timeout_s)
                except TimeoutError:
                    raise Retryable(
                        f"{ep.url}: its requests in flight did not end within {client.load_timeout_s:g}s "
                        f"of the reload of version {version}",
                        "reload drain",
                    ) from None
                try:
                    version = await self.paused_load(client, ep, version, path, PAUSE_MODES[mode])
                except BaseException:
                    # Paused (or maybe), its weights either version: unknown until a reload succeeds.
                    # The endpoint's next request reloads it first, and that reload's /resume ends
                    # the pause.
                    ep.version = -1
                    raise
                ep.version = max(ep.version, version)  # before `reloading` is dropped: what the waiting requests read
                return version
            finally:
                state.reloading.set()
                state.reloading = None

    async def paused_load(
        self, client: WeightSyncClient[EndpointT], ep: EndpointT, version: int, path: str, mode: str
    ) -> int:
        """Pause ``ep`` (``mode``), load the weights, reset its prefix cache and resume it: the
        version it now holds. The steps between the drain and the resume, which a dialect that
        loads another way (`vllm_push`) replaces."""
        await on_each_engine(client, ep, "POST", f"/pause?mode={mode}", timeout=client.load_timeout_s)
        await on_each_engine(
            client,
            ep,
            "POST",
            "/collective_rpc",
            {"method": "reload_weights", "kwargs": {"weights_path": path}},
            timeout=client.load_timeout_s,
        )
        await reset_prefix_cache_and_resume(client, ep, version, mode, f"the reload of {path}")
        return version

    async def before_attempt(self, client: WeightSyncClient[EndpointT], ep: EndpointT) -> None:
        """Exact versions: none is sent during a reload, nor after one that failed (the
        endpoint's weights are unknown until it loads again)."""
        state: ReloadState = ep.sync
        while state.reloading is not None:  # each reload's steps are bounded by the load timeout
            await state.reloading.wait()
        if ep.version < 0 and client.target is not None:
            failed = f"{ep.url}: its weight reload failed ({ep.last_error})"
            raise Retryable(failed, "weight sync", counted=ep.failures > 0)

    def answer_versions(
        self, client: WeightSyncClient[EndpointT], ep: EndpointT, version: int, start: int
    ) -> tuple[int, int]:
        """The version it was sent at: no reload runs while it is in flight."""
        return start, start


async def reset_prefix_cache_and_resume(
    client: WeightSyncClient[EndpointT], ep: EndpointT, version: int, mode: str, after: str
) -> None:
    """The last steps of a load of ``version`` on every engine of ``ep`` (a router's all pause,
    and all load, before any resumes: no request of the endpoint is sampled by a mix of
    versions), paused with ``mode``; ``after``: the load, as a failure names it. mode keep: the
    engines label the weights ``version`` (each token reports the label of the weights that
    sampled it) and send their frozen requests back to the queue with the cache reset."""
    if mode == "keep":
        label = {"new_version": str(version)}
        await on_each_engine(client, ep, "POST", "/update_weight_version", label, timeout=client.load_timeout_s)
    # Without it, prompts longer than a cache block seen before are served from the old weights' KV.
    reset = "/reset_prefix_cache?reset_running_requests=true" if mode == "keep" else "/reset_prefix_cache"
    answers = await on_each_engine(client, ep, "POST", reset, timeout=client.load_timeout_s)
    for url, answer in zip(ep.admin_urls, answers, strict=True):
        if not (isinstance(answer, dict) and answer.get("success") is True):  # the server's state, not the request
            raise Retryable(f"{url}/reset_prefix_cache failed after {after}: {answer!r}", "reload")
    await on_each_engine(client, ep, "POST", "/resume", timeout=client.load_timeout_s)
