"""What a weight-sync dialect uses of the inference client (a Protocol, so that the dialects do
not import the client, which dispatches to them), and the checks they share."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

from orchestrator.inference.errors import InferenceRequestError, Retryable


class SyncedEndpoint(Protocol):
    """An endpoint's state as the dialects read and update it (`client.Endpoint`)."""

    url: str
    version: int  # newest weight version it confirmed (-1: unknown)
    idle: asyncio.Event  # set while no sampling call is in flight
    abortable: asyncio.Event  # interrupt: set while no call of another route than /v1/completions is in flight

    @property
    def admin_urls(self) -> tuple[str, ...]: ...  # where its weights are loaded: a router's engines, else its URL

    def restart_unstarted(self) -> None: ...  # interrupt: ends the streams without a first token (sent again)

    reloading: asyncio.Event | None  # vllm_reload: set (and dropped) once a reload is done
    adapters: dict[int, int]  # vllm_lora: version loaded -> its requests in flight
    adapter_released: asyncio.Event  # vllm_lora: an adapter's count hit 0


EndpointT = TypeVar("EndpointT", bound=SyncedEndpoint)


class WeightSyncClient(Protocol[EndpointT]):
    """The inference client as a dialect drives it, over its kind of endpoint."""

    load_timeout_s: float
    max_loras: int
    update_mode: str  # "wait" | "interrupt" (vllm_reload)
    model: str | None

    @property
    def endpoints(self) -> Sequence[EndpointT]: ...

    @property
    def weight_sync(self) -> str: ...

    async def call(
        self,
        ep: EndpointT,
        method: str,
        path: str,
        body: Any = None,
        timeout: float | None = None,
        text: bool = False,
        *,
        base: str | None = None,
    ) -> Any: ...


async def on_each_engine(
    client: WeightSyncClient[EndpointT], ep: EndpointT, method: str, path: str, *args: Any, **options: Any
) -> list[Any]:
    """`client.call(ep, method, path, *args, **options)` on every engine whose weights `ep` serves
    (a router's engines, else `ep` itself), all at once; their answers, in order. Every call ends
    (each has its timeout) before a failure is raised, so none is left running. Some engines
    failing where others succeeded is Retryable: the router's engines may now differ, so it is
    marked down, its version unknown, and its next request loads every engine again."""
    answers = await asyncio.gather(
        *(client.call(ep, method, path, *args, **options, base=url) for url in ep.admin_urls),
        return_exceptions=True,
    )
    failed = [(url, a) for url, a in zip(ep.admin_urls, answers, strict=True) if isinstance(a, BaseException)]
    for _url, answer in failed:
        if not isinstance(answer, Exception):  # a cancel (a stop) is a cancel, whatever else failed
            raise answer
    if failed and len(failed) < len(answers):
        what = "; ".join(f"{url}: {error}" for url, error in failed)
        raise Retryable(f"{ep.url}: {path} failed on some of its engines, not all ({what})", "engine mismatch")
    if failed:
        raise failed[0][1]
    return list(answers)


def check_weights_dir(path: str, marker: str, what: str) -> None:
    """InferenceRequestError unless ``path`` holds ``marker`` and a ``*.safetensors`` file."""
    wdir = Path(path)
    if not (wdir / marker).is_file() or not any(wdir.glob("*.safetensors")):
        raise InferenceRequestError(
            f"{wdir} is not {what} ({marker} and *.safetensors): the trainer publishes "
            "another kind of weights than this weight_sync loads"
        )
