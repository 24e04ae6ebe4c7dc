"""`vllm_lora`: LoRA adapters of a vLLM server (``--enable-lora``,
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``): version N is the adapter ``step_N``, ``POST
/v1/load_lora_adapter``; requests then name ``model="step_N"``, so the version of a completion is
exactly the adapter it asked for. Every version is an adapter (step_0 too: no base-model request
shares vLLM-CPU's batches with adapter ones, which gives those wrong logprobs); to make room for a
new one, the oldest that no request uses is unloaded (``/v1/unload_lora_adapter``), so an
endpoint holds at most ``max_loras``: the newest versions."""

from __future__ import annotations

import asyncio

from orchestrator.inference.errors import InferenceRequestError, Retryable
from orchestrator.inference.weight_sync.base import EndpointT, WeightSyncClient, check_weights_dir, on_each_engine


async def load(client: WeightSyncClient[EndpointT], ep: EndpointT, version: int, path: str) -> int:
    """vLLM LoRA (``--enable-lora``, VLLM_ALLOW_RUNTIME_LORA_UPDATING=True): version N is the
    adapter ``step_N``. The newest ``max_loras`` stay loaded (an eval pinned to a recent version
    samples with its adapter); to make room, the oldest that no request in flight uses is
    unloaded, and the load waits for one to be free, so an endpoint never holds more."""
    check_weights_dir(path, "adapter_config.json", "a PEFT adapter dir")
    if ep.version < 0:  # a new client, or the endpoint failed: what it holds is unknown
        await _adopt_listed_adapters(client, ep)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + client.load_timeout_s
    while len(ep.adapters) >= client.max_loras:
        unused = sorted(v for v, users in ep.adapters.items() if users == 0 and v != ep.version)
        if unused:
            await _unload_adapter(client, ep, unused[0])
            continue
        ep.adapter_released.clear()
        try:
            await asyncio.wait_for(ep.adapter_released.wait(), max(0.0, deadline - loop.time()))
        except TimeoutError:
            raise Retryable(
                f"{ep.url}: adapters {sorted(ep.adapters)} still in use {client.load_timeout_s:g}s "
                f"after adapter {lora_name(version)} was asked for",
                "adapter room",
            ) from None
    # In place: a step_N left by an earlier run of this name (a crash before N was recorded)
    # is replaced rather than kept.
    await on_each_engine(
        client,
        ep,
        "POST",
        "/v1/load_lora_adapter",
        {"lora_name": lora_name(version), "lora_path": path, "load_inplace": True},
        timeout=client.load_timeout_s,
        text=True,
    )
    ep.adapters.setdefault(version, 0)
    return version


async def _adopt_listed_adapters(client: WeightSyncClient[EndpointT], ep: EndpointT) -> None:
    """Count the ``step_N`` adapters any engine of the endpoint lists as loaded, so they are
    unloaded too."""
    for listed in await on_each_engine(client, ep, "GET", "/v1/models"):
        for entry in listed.get("data", []) if isinstance(listed, dict) else []:
            name = entry.get("id") if isinstance(entry, dict) and entry.get("parent") is not None else None
            version = adapter_version(name) if isinstance(name, str) else None
            if version is not None:
                ep.adapters.setdefault(version, 0)


async def _unload_adapter(client: WeightSyncClient[EndpointT], ep: EndpointT, old: int) -> None:
    """Unload adapter ``old``, which no request uses; forgotten first, so that no request
    (one pinned to ``old`` looks it up) takes it up meanwhile."""
    del ep.adapters[old]
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
