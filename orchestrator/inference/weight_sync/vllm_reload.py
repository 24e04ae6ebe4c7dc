"""`vllm_reload`: a vLLM server's full-weight reload (``VLLM_SERVER_DEV_MODE=1``): ``POST
/pause?mode=wait`` (update_mode interrupt: ``mode=abort``) -> ``POST /collective_rpc {"method":
"reload_weights", ...}`` -> ``POST /reset_prefix_cache`` -> ``POST /resume``. No request of an
endpoint is sent while it reloads, so a completion's version is the one it was sent at."""

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


@dataclass
class ReloadState:
    reloading: asyncio.Event | None = None  # set (and dropped) once the reload running is done


class VllmReload(WeightSyncDialect):
    engine = "vllm"
    summary = "vLLM full reload (/pause, reload_weights, /reset_prefix_cache, /resume)"
    update_modes = frozenset({"wait", "interrupt"})
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
        reload. Either way each token's version is exact."""
        state: ReloadState = ep.sync
        async with versions_held(path, client.load_timeout_s):
            check_weights_dir(path, "config.json", "an HF model dir")  # a failed reload kills vLLM's engine
            state.reloading = asyncio.Event()
            interrupt = client.update_mode == "interrupt"
            try:
                if interrupt:
                    ep.restart_unstarted()
                try:
                    await asyncio.wait_for((ep.abortable if interrupt else ep.idle).wait(), client.load_timeout_s)
                except TimeoutError:
                    raise Retryable(
                        f"{ep.url}: its requests in flight did not end within {client.load_timeout_s:g}s "
                        f"of the reload of version {version}",
                        "reload drain",
                    ) from None
                try:
                    version = await self.paused_load(client, ep, version, path, "abort" if interrupt else "wait")
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
        await _paused_reload(client, ep, path, mode)
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


async def _paused_reload(client: WeightSyncClient[EndpointT], ep: EndpointT, path: str, mode: str) -> None:
    """Each step on every engine of the endpoint (a router's all pause, and all reload, before
    any resumes: no request of the endpoint is sampled by a mix of versions)."""
    await on_each_engine(client, ep, "POST", f"/pause?mode={mode}", timeout=client.load_timeout_s)
    await on_each_engine(
        client,
        ep,
        "POST",
        "/collective_rpc",
        {"method": "reload_weights", "kwargs": {"weights_path": path}},
        timeout=client.load_timeout_s,
    )
    await reset_prefix_cache_and_resume(client, ep, f"the reload of {path}")


async def reset_prefix_cache_and_resume(client: WeightSyncClient[EndpointT], ep: EndpointT, after: str) -> None:
    """The last steps of a load on every engine of ``ep`` (``after``: the load, as a failure names it)."""
    # Without it, prompts longer than a cache block seen before are served from the old weights' KV.
    answers = await on_each_engine(client, ep, "POST", "/reset_prefix_cache", timeout=client.load_timeout_s)
    for url, answer in zip(ep.admin_urls, answers, strict=True):
        if not (isinstance(answer, dict) and answer.get("success") is True):  # the server's state, not the request
            raise Retryable(f"{url}/reset_prefix_cache failed after {after}: {answer!r}", "reload")
    await on_each_engine(client, ep, "POST", "/resume", timeout=client.load_timeout_s)
