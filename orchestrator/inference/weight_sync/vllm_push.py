"""`vllm_push`: the trainer process broadcasts each version into a vLLM server over a
process group (gloo on the CPU, NCCL on GPUs), instead of the server reading it from disk. Per version, on
every engine of the endpoint: ``POST /pause`` (update_mode wait, interrupt or keep, as
`vllm_reload`) -> ``POST /start_weight_update`` -> ``POST /update_weights`` while the trainer
broadcasts -> ``POST /finish_weight_update {"weight_version"}`` -> ``POST /reset_prefix_cache``
-> ``POST /resume``. Versions are exact as with `vllm_reload`: no request is sent while it loads. An
engine whose push fails (the trainer gone mid-push, its push service down, a group that timed
out) reloads the version from ``weights/step_N`` instead, still paused: no engine serves a
version it got part of.

The control plane (orchestrator/weight_push/__init__.py tells it whole): this dialect drives it.
The trainer's push service (`orchestrator.weight_push.sender.PushService`, its address in
``RUN_DIR/weights/push.json``) opens a group per server (``POST /channel``), which the server
joins (``POST /init_weight_transfer_engine``); a push is the server's ``/update_weights`` and
the trainer's ``POST /push`` at once, each an HTTP call bounded by the load timeout (with gloo,
each side's collective is bounded by the group's timeout, shorter: a side left alone gives up
first)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from pathlib import Path

from orchestrator.inference.errors import Retryable
from orchestrator.inference.weight_sync.base import (
    EndpointT,
    LaunchSettings,
    RouteProbe,
    SyncedEndpoint,
    WeightSyncClient,
    on_each_engine,
)
from orchestrator.inference.weight_sync.vllm_reload import ReloadState, VllmReload, reset_prefix_cache_and_resume
from orchestrator.weight_push import GLOO_BACKEND, NCCL_BACKEND, PUSH_INFO

PLUGIN = "orchestrator.weight_push.vllm_plugin:register"  # its entry point (pyproject.toml): GLOO_BACKEND
log = logging.getLogger("orch.inference")


@dataclass
class PushState(ReloadState):
    # engine URL -> the trainer instance whose group it joined (a restarted trainer, a failed push
    # or a restarted server: joined anew before the next push)
    joined: dict[str, str] = field(default_factory=dict)
    # the trainer instance and its tensors' names, dtypes and shapes (the same for every version)
    update_info: tuple[str, dict] | None = None


class VllmPush(VllmReload):
    engine = "vllm"
    summary = "vLLM weight push from the trainer process over a process group (gloo on the CPU, NCCL on GPUs)"
    pushed = True
    # An empty init info: refused by the engine's parser where the transfer is set up (nothing is
    # joined), by the worker ("not configured") where it is not; a plain 404 without the dev mode.
    route_probe = RouteProbe(
        "POST",
        "/init_weight_transfer_engine",
        needs=f'VLLM_SERVER_DEV_MODE=1 and --weight-transfer-config \'{{"backend": "{GLOO_BACKEND}"}}\' '
        "(nccl on GPUs), orch installed in its Python (its vLLM plugin)",
        body={"init_info": {}},
        unset="Weight transfer not configured",
    )

    def launch_args(self, launch: LaunchSettings, max_loras: int) -> list[str]:
        backend = {"nccl": NCCL_BACKEND, "gloo": GLOO_BACKEND}[self.launched_push_transport(launch)]
        return ["--weight-transfer-config", json.dumps({"backend": backend})]

    def launched_push_transport(self, launch: LaunchSettings) -> str:
        """GPU servers run vLLM's own NCCL engine, CPU servers orch's gloo one."""
        return "nccl" if launch.gpus else "gloo"

    def launch_lacks(self, launch: LaunchSettings) -> str | None:
        """CPU servers: orch's vLLM plugin, which registers the ``orch_gloo`` engine, an entry
        point of orch's install (an orch installed before it had one lacks it until it is
        installed again). GPU servers run vLLM's own engine."""
        plugins = entry_points(group="vllm.general_plugins")
        if self.launched_push_transport(launch) == "nccl" or any(plugin.value == PLUGIN for plugin in plugins):
            return None
        return (
            "whose installed orch does not register its vLLM plugin (the weight_sync 'vllm_push' engine "
            f"{GLOO_BACKEND}): install orch again there (pip install -e .)"
        )

    def new_state(self) -> PushState:
        return PushState()

    def server_lost(self, ep: SyncedEndpoint) -> None:
        ep.sync.joined.clear()  # a new server holds no group

    async def paused_load(
        self, client: WeightSyncClient[EndpointT], ep: EndpointT, version: int, path: str, mode: str
    ) -> int:
        """Pause every engine, push into each in turn (an engine whose push fails reloads
        ``path`` instead), reset and resume them all: the version sent (the trainer's newest,
        ``version`` or newer: every engine must get the same one)."""
        state: PushState = ep.sync
        await on_each_engine(client, ep, "POST", f"/pause?mode={mode}", timeout=client.load_timeout_s)
        sent: dict[str, int] = {}
        for url in ep.admin_urls:
            try:
                sent[url] = await _push_one(client, ep, url, path, state, version)
            except BaseException as failed:
                state.joined.pop(url, None)  # its group is not trusted any more: joined anew next time
                if not isinstance(failed, Exception):  # a cancel (a stop) is a stop
                    raise
                sent[url] = await _reload_instead(client, ep, url, path, version, failed)
        if len(set(sent.values())) > 1:  # the trainer published between two engines' pushes
            raise Retryable(f"{ep.url}: its engines got versions {sent}", "engine mismatch")
        pushed = next(iter(sent.values()))
        await reset_prefix_cache_and_resume(client, ep, pushed, mode, f"the push of version {pushed}")
        return pushed


async def _reload_instead(
    client: WeightSyncClient[EndpointT], ep: EndpointT, url: str, path: str, version: int, failed: Exception
) -> int:
    """A push that failed (the trainer gone mid-push or before it, a group that timed out): the
    engine, still paused, reloads the version from ``path``, which the trainer wrote before
    publishing it, so that its weights, part pushed or not, are all that version's. If the
    reload fails too, so does the load (the endpoint's version unknown until it loads again)."""
    log.warning("orch: the push of version %d into %s failed (%s); reloading it from %s", version, url, failed, path)
    body = {"method": "reload_weights", "kwargs": {"weights_path": path}}
    try:
        await client.call(ep, "POST", "/collective_rpc", body, timeout=client.load_timeout_s, base=url)
    except Retryable as dropped:
        if dropped.timed_out or dropped.server_error is not None:  # the reload's own failure
            raise
        # vLLM closes the connection its failed /update_weights answered on, which the client's
        # pool may hand this call: once more, on a new one.
        await client.call(ep, "POST", "/collective_rpc", body, timeout=client.load_timeout_s, base=url)
    return version


async def _push_one(
    client: WeightSyncClient[EndpointT],
    ep: EndpointT,
    url: str,
    path: str,
    state: PushState,
    version: int,
) -> int:
    """One engine (paused): join the group of the trainer that serves ``path``'s versions
    (``push.json`` beside them) if it has not, then the push: the server receives while the
    trainer sends, both bounded by the load timeout."""
    timeout = client.load_timeout_s
    info = json.loads((Path(path).parent / PUSH_INFO).read_text())  # gone: the trainer is down
    trainer, instance = info["url"], info["instance"]
    if state.joined.get(url) != instance:
        world = await client.call(ep, "GET", "/get_world_size", timeout=timeout, base=url)
        init_info = await client.call(
            ep, "POST", "/channel", {"key": url, "world_size": 1 + int(world["world_size"])}, timeout, base=trainer
        )
        # the group it held first (vLLM's NCCL engine does not release it when it joins another)
        await client.call(ep, "POST", "/shutdown_weight_transfer_engine", timeout=timeout, base=url)
        await client.call(ep, "POST", "/init_weight_transfer_engine", {"init_info": init_info}, timeout, base=url)
        state.joined[url] = instance
    if state.update_info is None or state.update_info[0] != instance:
        meta = await client.call(ep, "GET", "/metadata", timeout=timeout, base=trainer)
        state.update_info = instance, {key: meta[key] for key in ("names", "dtype_names", "shapes")}
    update_info = state.update_info[1]
    await client.call(ep, "POST", "/start_weight_update", timeout=timeout, base=url)
    receive = asyncio.ensure_future(
        client.call(ep, "POST", "/update_weights", {"update_info": update_info}, timeout, base=url)
    )
    send = asyncio.ensure_future(
        client.call(ep, "POST", "/push", {"key": url, "version": version}, timeout, base=trainer)
    )
    # Both end before a failure is raised: none is left running. Each call has its timeout, and
    # each side's collective gives up at the group's timeout when the other is gone; a side that
    # failed first (a refused /update_weights, say) has the trainer abort its group, so that its
    # broadcast, and the worker's receive with it, fail now rather than at that timeout.
    try:
        done, _ = await asyncio.wait((receive, send), return_when=asyncio.FIRST_EXCEPTION)
        if any(task.exception() is not None for task in done) and not send.done():
            with contextlib.suppress(Exception):  # it ends at its timeout anyway
                await client.call(ep, "POST", "/close", {"key": url}, timeout, base=trainer)
        received, answer = await asyncio.gather(receive, send, return_exceptions=True)
    finally:  # the load cancelled (a stop): its calls with it
        for task in (receive, send):
            task.cancel()
    for outcome in (received, answer):
        if isinstance(outcome, BaseException):
            raise outcome
    pushed = int(answer["version"])
    await client.call(ep, "POST", "/finish_weight_update", {"weight_version": str(pushed)}, timeout, base=url)
    return pushed
