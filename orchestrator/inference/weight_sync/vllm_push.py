"""`vllm_push` (prototype): the trainer process broadcasts each version into a vLLM server over a
process group (gloo on the CPU), instead of the server reading it from disk. Per version, on
every engine of the endpoint: ``POST /pause`` (update_mode wait or interrupt, as `vllm_reload`)
-> ``POST /start_weight_update`` -> ``POST /update_weights`` while the trainer broadcasts ->
``POST /finish_weight_update {"weight_version"}`` -> ``POST /reset_prefix_cache`` -> ``POST
/resume``. Versions are exact as with `vllm_reload`: no request is sent while it loads.

The control plane (orchestrator/weight_push/__init__.py tells it whole): this dialect drives it.
The trainer's push service (`orchestrator.weight_push.sender.PushService`, its address in
``RUN_DIR/weights/push.json``) opens a group per server (``POST /channel``), which the server
joins (``POST /init_weight_transfer_engine``); a push is the server's ``/update_weights`` and
the trainer's ``POST /push`` at once, each an HTTP call bounded by the load timeout, each side's
collective bounded by the group's timeout (shorter: a side left alone gives up first)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.inference.errors import InferenceRequestError, Retryable
from orchestrator.inference.weight_sync.base import (
    EndpointT,
    LaunchSettings,
    RouteProbe,
    SyncedEndpoint,
    WeightSyncClient,
    on_each_engine,
)
from orchestrator.inference.weight_sync.vllm_reload import ReloadState, VllmReload, reset_prefix_cache_and_resume

BACKEND = "orch_gloo"  # orchestrator/weight_push/vllm_plugin.py registers it in vLLM
PUSH_INFO = "push.json"  # beside the versions: RUN_DIR/weights/push.json (orchestrator.weight_push.sender)


@dataclass
class PushState(ReloadState):
    # engine URL -> the trainer instance whose group it joined (a restarted trainer, a failed push
    # or a restarted server: joined anew before the next push)
    joined: dict[str, str] = field(default_factory=dict)


class VllmPush(VllmReload):
    engine = "vllm"
    summary = "vLLM weight push from the trainer process over a process group (prototype: gloo, CPU)"
    default_update_mode = "wait"  # a prototype: interrupt works as with vllm_reload, unmeasured here
    prototype = True
    route_probe = RouteProbe(
        "GET",
        "/get_world_size",
        needs=f'VLLM_SERVER_DEV_MODE=1 and --weight-transfer-config \'{{"backend": "{BACKEND}"}}\'',
    )

    def launch_args(self, launch: LaunchSettings, max_loras: int) -> list[str]:
        return ["--weight-transfer-config", json.dumps({"backend": BACKEND})]

    def new_state(self) -> PushState:
        return PushState()

    def server_lost(self, ep: SyncedEndpoint) -> None:
        ep.sync.joined.clear()  # a new server holds no group

    def check_source(self, path: str) -> None:
        """The trainer's push service is where the versions are (it need not be up yet: the
        load asks it, within the load's bound)."""
        if not (Path(path).parent / PUSH_INFO).is_file():
            raise InferenceRequestError(
                f"{Path(path).parent / PUSH_INFO} is missing: weight_sync vllm_push needs a trainer that "
                "pushes its versions (trainer.hf.push.enabled = true: its push service writes that file)"
            )

    async def paused_load(
        self, client: WeightSyncClient[EndpointT], ep: EndpointT, version: int, path: str, mode: str
    ) -> int:
        """Pause every engine, push into each in turn, reset and resume them all: the version sent
        (the trainer's newest, ``version`` or newer: every engine must get the same one)."""
        state: PushState = ep.sync
        info = json.loads((Path(path).parent / PUSH_INFO).read_text())
        trainer, instance = info["url"], info["instance"]
        await on_each_engine(client, ep, "POST", f"/pause?mode={mode}", timeout=client.load_timeout_s)
        sent: dict[str, int] = {}
        for url in ep.admin_urls:
            try:
                sent[url] = await _push_one(client, ep, url, trainer, instance, state, version)
            except BaseException:
                state.joined.pop(url, None)  # its group is not trusted any more: joined anew next time
                raise
        if len(set(sent.values())) > 1:  # the trainer published between two engines' pushes
            raise Retryable(f"{ep.url}: its engines got versions {sent}", "engine mismatch")
        pushed = next(iter(sent.values()))
        await reset_prefix_cache_and_resume(client, ep, f"the push of version {pushed}")
        return pushed


async def _push_one(
    client: WeightSyncClient[EndpointT],
    ep: EndpointT,
    url: str,
    trainer: str,
    instance: str,
    state: PushState,
    version: int,
) -> int:
    """One engine (paused): join the trainer's group if it has not, then the push: the server
    receives while the trainer sends, both bounded by the load timeout."""
    timeout = client.load_timeout_s
    if state.joined.get(url) != instance:
        world = await client.call(ep, "GET", "/get_world_size", timeout=timeout, base=url)
        init_info = await client.call(
            ep, "POST", "/channel", {"key": url, "world_size": 1 + int(world["world_size"])}, timeout, base=trainer
        )
        await client.call(ep, "POST", "/init_weight_transfer_engine", {"init_info": init_info}, timeout, base=url)
        state.joined[url] = instance
    meta = await client.call(ep, "GET", "/metadata", timeout=timeout, base=trainer)
    update_info = {key: meta[key] for key in ("names", "dtype_names", "shapes")}
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
