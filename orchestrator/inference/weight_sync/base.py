"""The interface of a weight-sync dialect (:class:`WeightSyncDialect`), what a dialect uses of the
inference client and of the launch settings (Protocols, so that the dialects import neither the
client nor the config, which ask them), and the helpers they share."""

from __future__ import annotations

import abc
import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, Protocol, TypeVar

from orchestrator import rundir
from orchestrator.inference.errors import InferenceRequestError, Retryable

UpdateMode = Literal["wait", "interrupt", "keep"]  # what a weight update does to the requests running


class SyncedEndpoint(Protocol):
    """An endpoint as the dialects read and update it (`client.Endpoint`)."""

    url: str
    version: int  # newest weight version it confirmed (-1: unknown)
    sync: Any  # its dialect's state (`WeightSyncDialect.new_state`)
    failures: int  # failed contacts in a row (0: up)
    last_error: str | None
    idle: asyncio.Event  # set while no sampling call is in flight
    abortable: asyncio.Event  # interrupt, keep: set while no call of another route than its completions' is in flight

    @property
    def admin_urls(self) -> tuple[str, ...]: ...  # where its weights are loaded: a router's engines, else its URL

    def restart_unstarted(self) -> None: ...  # interrupt: ends the streams without a first token (sent again)


EndpointT = TypeVar("EndpointT", bound=SyncedEndpoint)


class WeightSyncClient(Protocol[EndpointT]):
    """The inference client as a dialect drives it, over its kind of endpoint."""

    load_timeout_s: float
    max_loras: int
    model: str | None
    target: tuple[int, str] | None  # (version, weights dir) every endpoint should hold

    @property
    def update_mode(self) -> UpdateMode: ...

    @property
    def endpoints(self) -> Sequence[EndpointT]: ...

    @property
    def weight_sync(self) -> str: ...

    @property
    def dialect(self) -> WeightSyncDialect: ...

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


class LaunchSettings(Protocol):
    """What a dialect reads of the servers a run launches (`inference.openai.launch`)."""

    max_lora_rank: int
    gpus: list[str]  # each server's CUDA_VISIBLE_DEVICES (empty: CPU servers)


@dataclass(frozen=True)
class RouteProbe:
    """A call that shows, before a run, that a given vLLM server has a dialect's routes: the
    route answers, or refuses what it was asked with a 404 that says what "cannot be found"
    (or a server error that does not say ``unset``); a server without it answers a plain 404."""

    method: str
    path: str
    needs: str  # how vLLM is started to have the route, as the check's message says it
    body: Any = None
    text: bool = False  # the answer is text, not JSON
    # what the route's server error says when the route is there but what serves it was not set up
    unset: str | None = None


class WeightSyncDialect(abc.ABC):
    """How endpoints load a published version, and what that means for the sampling calls: the
    points the inference client calls it at. The defaults are a dialect's whose endpoints sample
    with the version they confirmed last; each dialect is one module, one class of this, which
    also says what the config, the pre-run checks and the launched servers need of it."""

    # The engine whose weights it loads ("vllm", "sglang", "orch": as the pre-run check tells
    # engines apart); None: weights are loaded outside orch, the client only records the version.
    # Each dialect names its own.
    engine: ClassVar[str | None]
    summary: ClassVar[str]  # how it loads a version, in the words of the config's description
    update_modes: ClassVar[frozenset[UpdateMode]] = frozenset({"wait"})  # the `update_mode`s it offers
    default_update_mode: ClassVar[UpdateMode] = "wait"  # the `update_mode` used where none is set
    # why it offers only some update modes, said when a config asks for another (None: nothing to add)
    update_modes_note: ClassVar[str | None] = None
    route_probe: ClassVar[RouteProbe | None] = None  # vLLM: the call that shows a given server has its routes
    # Its versions come from the trainer process (pushed), not from the weights dir: the run's
    # trainer must push them (`TrainerComponent.push_refusal`).
    pushed: ClassVar[bool] = False

    @property
    def loads(self) -> bool:
        """It loads each version on the endpoints (else the client only records the version)."""
        return self.engine is not None

    def launch_args(self, launch: LaunchSettings, max_loras: int) -> list[str]:
        """The `vllm serve` flags a launched server needs for this dialect."""
        return []

    def launched_push_transport(self, launch: LaunchSettings) -> str | None:
        """What servers launched with `launch` receive pushed versions over (the trainer's
        transport must be the same): None where versions are not pushed."""
        return None

    def launch_env(self) -> dict[str, str]:
        """The environment a launched vLLM server needs for this dialect."""
        return {}

    def launch_lacks(self, launch: LaunchSettings) -> str | None:
        """What this interpreter's vLLM lacks for this dialect, said after "the run's launched
        servers run in <python>,"; None: nothing."""
        return None

    def new_state(self) -> Any:
        """An endpoint's state of this dialect (`Endpoint.sync`), made with the endpoint."""
        return None

    @abc.abstractmethod
    async def load(self, client: WeightSyncClient[EndpointT], ep: EndpointT, version: int, path: str) -> int:
        """Load weights dir ``path`` as ``version`` on ``ep``: the version it confirmed. One load
        of an endpoint at a time."""

    def server_lost(self, ep: SyncedEndpoint) -> None:
        """``ep``'s server ended and is started afresh: it holds only the model as launched."""
        return None  # a dialect without per-endpoint state has nothing to forget

    def known_version(self, client: WeightSyncClient[EndpointT], ep: EndpointT) -> int:
        """The version ``ep`` is known to hold."""
        return ep.version

    def sample_with(
        self, client: WeightSyncClient[EndpointT], ep: EndpointT, version: int, at_version: int | None
    ) -> tuple[int, str | None]:
        """A sampling call's version and the model it names (None: none), given the version
        ``ep`` is brought to and the call's eval pin (``at_version``)."""
        return version, client.model

    async def before_attempt(self, client: WeightSyncClient[EndpointT], ep: EndpointT) -> None:
        """Before each attempt of a sampling call on ``ep`` (again after a reload ended it)."""
        return None  # a dialect whose loads never hold a call back: nothing to wait for

    @contextlib.contextmanager
    def in_flight(self, ep: SyncedEndpoint, version: int) -> Iterator[None]:
        """Around a sampling call at ``version`` while it is in flight."""
        yield

    def answer_versions(
        self, client: WeightSyncClient[EndpointT], ep: EndpointT, version: int, start: int
    ) -> tuple[int, int]:
        """The versions an answer reports (sampled by, ended at), of a call at ``version`` sent
        when ``ep`` was known to hold ``start``: bounded by the versions known when it was sent
        and when it came back."""
        return start, max(start, self.known_version(client, ep))


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


@contextlib.asynccontextmanager
async def versions_held(path: str, timeout_s: float) -> AsyncIterator[None]:
    """The weight versions beside `path` held against the trainer's prune while an endpoint
    loads one (rundir.hold_versions): the trainer prunes at its next publish instead. A
    prune holds them for milliseconds; waited for at most `timeout_s` (the load timeout)."""
    deadline = time.monotonic() + timeout_s
    while (held := rundir.hold_versions(path, exclusive=False)) is None:
        if time.monotonic() >= deadline:
            raise Retryable(f"the trainer's prune held {path}'s versions for {timeout_s:g}s", "reload")
        await asyncio.sleep(0.01)
    try:
        yield
    finally:
        rundir.release_versions(held)


def check_weights_dir(path: str, marker: str, what: str) -> None:
    """InferenceRequestError unless ``path`` holds ``marker`` and a ``*.safetensors`` file."""
    wdir = Path(path)
    if not (wdir / marker).is_file() or not any(wdir.glob("*.safetensors")):
        raise InferenceRequestError(
            f"{wdir} is not {what} ({marker} and *.safetensors): the trainer publishes "
            "another kind of weights than this weight_sync loads"
        )
