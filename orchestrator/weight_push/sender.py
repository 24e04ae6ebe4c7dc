"""The trainer's side of a weight push: :class:`WeightPushSender` holds the newest published
version's tensors and one channel (a group of its transport) per vLLM server, and broadcasts the
version in buckets when asked; :class:`PushService` is how the orchestrator asks (a small HTTP
server in the trainer process, its address in ``RUN_DIR/weights/push.json``).

Why the orchestrator asks rather than the trainer pushing on its own: the orchestrator's client
owns each server's pause, resume and the version every completion records (the `vllm_push`
dialect), and a broadcast needs both sides in the same collective at the same time. So the
dialect drives the server's routes and, while the server's ``/update_weights`` waits in the
collective, asks the trainer to broadcast (``POST /push``). The trainer only answers.

Every wait is bounded: with gloo, a channel's rendezvous and each broadcast by the group's
timeout (gloo raises after it); with either transport, a whole push by ``push_timeout_s`` (it
runs in the channel's thread, the request waits for it with that deadline, and on expiry the
group is closed and dropped: the next load opens a fresh one)."""

from __future__ import annotations

import concurrent.futures
import json
import os
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import torch

from orchestrator.weight_push.buckets import ParamSpec
from orchestrator.weight_push.transport import Transport


class PushError(RuntimeError):
    pass


class _NoRoute(LookupError):
    pass


@dataclass
class _Snapshot:
    """A version as it travels: its tensors' specs and the copy its transport holds (made once,
    when the version is handed over, rather than at every push to every server)."""

    version: int
    specs: list[ParamSpec]
    held: Any  # Transport.hold's


@dataclass
class _Channel:
    """The group with one server's workers (ranks 1..world_size-1) and the thread that runs its
    collectives: one at a time, the group's rendezvous first."""

    runner: concurrent.futures.ThreadPoolExecutor
    group: concurrent.futures.Future  # -> the transport's group, once every rank joined
    lock: threading.Lock = field(default_factory=threading.Lock)

    def close(self) -> None:
        def close_group(group: concurrent.futures.Future) -> None:  # now, or once a rendezvous under way ends
            if not group.cancelled() and group.exception() is None:
                group.result().close()

        self.group.add_done_callback(close_group)
        self.runner.shutdown(wait=False, cancel_futures=True)  # a collective blocked in it fails at its timeout


class WeightPushSender:
    """What the trainer process keeps to push versions: the newest version's tensors (a copy in
    ``wire_dtype``: training goes on while a push reads them) and the channels."""

    def __init__(
        self,
        transport: Transport,
        *,
        timeout_s: float,
        push_timeout_s: float,
        host: str = "127.0.0.1",
        wire_dtype: torch.dtype | None = None,
    ):
        self.transport = transport
        self.host, self.timeout_s = host, timeout_s
        self.push_timeout_s, self.wire_dtype = push_timeout_s, wire_dtype
        self.instance = uuid.uuid4().hex  # a restarted trainer is another instance: servers join anew
        self._snapshot: _Snapshot | None = None
        self._channels: dict[str, _Channel] = {}
        self._cond = threading.Condition()

    @property
    def bucket_bytes(self) -> int:
        return self.transport.bucket_bytes

    # -- versions ------------------------------------------------------------------------------
    def set_version(self, version: int, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Hold ``tensors`` (name, tensor: HF checkpoint names, as vLLM loads them) as ``version``:
        a copy, as its transport sends it (training goes on while a push reads it). Called once
        the version is published (its STABLE marker written): a push sends published versions
        only, and one asked for before it is held waits for it."""
        named = [(name, t.detach()) for name, t in tensors]
        specs = [ParamSpec(name, self.wire_dtype or t.dtype, tuple(t.shape)) for name, t in named]
        if too_large := [spec for spec in specs if spec.nbytes > self.bucket_bytes]:
            raise PushError(
                f"{too_large[0].name} ({too_large[0].nbytes} bytes) is larger than a push bucket "
                f"({self.bucket_bytes} bytes): raise trainer.hf.push.bucket_mb"
            )
        snapshot = _Snapshot(version, specs, self.transport.hold(specs, [t for _, t in named]))
        with self._cond:
            if self._snapshot is None or version >= self._snapshot.version:
                self._snapshot = snapshot
            self._cond.notify_all()

    def _snapshot_at_least(self, version: int, timeout_s: float) -> _Snapshot:
        with self._cond:
            if not self._cond.wait_for(
                lambda: self._snapshot is not None and self._snapshot.version >= version, timeout_s
            ):
                held = None if self._snapshot is None else self._snapshot.version
                raise PushError(f"the trainer holds version {held}, not {version} or newer, after {timeout_s:g}s")
            assert self._snapshot is not None
            return self._snapshot

    def metadata(self) -> dict[str, Any]:
        """The newest version's tensors as vLLM's ``/update_weights`` takes them (the same for
        every version: only the values change)."""
        snapshot = self._snapshot_at_least(-1, self.timeout_s)
        names, dtypes, shapes = zip(*(spec.wire() for spec in snapshot.specs), strict=True)
        return {"version": snapshot.version, "names": list(names), "dtype_names": list(dtypes), "shapes": list(shapes)}

    # -- channels ------------------------------------------------------------------------------
    def open_channel(self, key: str, world_size: int) -> dict[str, Any]:
        """A new group for server ``key`` (replacing its old one): its rendezvous opens at once,
        and the group forms in the channel's thread as the server's workers join (its
        ``/init_weight_transfer_engine``, given what this returns), within the timeout."""
        if world_size < 2:
            raise PushError(f"a push group needs the trainer and at least one worker, not {world_size} ranks")
        self.close_channel(key)
        init_info, make_group = self.transport.open(self.host, world_size, self.timeout_s)
        runner = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"orch-push-{key}")
        group = runner.submit(make_group)
        with self._cond:
            self._channels[key] = _Channel(runner, group)
        return init_info

    def close_channel(self, key: str) -> None:
        with self._cond:
            channel = self._channels.pop(key, None)
        if channel is not None:
            channel.close()

    def push(self, key: str, version: int) -> int:
        """Broadcast the newest version (``version`` or newer) on ``key``'s channel: the version
        sent. Bounded by ``push_timeout_s`` in all; a failed or late push drops its channel (not
        one opened since)."""
        deadline = time.monotonic() + self.push_timeout_s
        with self._cond:
            channel = self._channels.get(key)
        if channel is None:
            raise PushError(f"no push channel for {key}: open one first")
        if not channel.lock.acquire(timeout=self.push_timeout_s):
            raise PushError(f"{key}: another push held its channel for {self.push_timeout_s:g}s")
        try:
            snapshot = self._snapshot_at_least(version, max(0.0, deadline - time.monotonic()))
            try:
                group = channel.group.result(timeout=max(0.0, deadline - time.monotonic()))
                sent = channel.runner.submit(self.transport.send, group, snapshot.held)
                sent.result(timeout=max(0.0, deadline - time.monotonic()))
            except BaseException as exc:
                self._drop(key, channel)
                if isinstance(exc, concurrent.futures.TimeoutError):
                    late = f"{key}: the push of version {snapshot.version} took over {self.push_timeout_s:g}s"
                    raise PushError(late) from None
                raise
            return snapshot.version
        finally:
            channel.lock.release()

    def _drop(self, key: str, channel: _Channel) -> None:
        """Close ``channel`` and forget it, unless ``key`` has another by now."""
        with self._cond:
            if self._channels.get(key) is channel:
                del self._channels[key]
        channel.close()

    def close(self) -> None:
        with self._cond:
            keys = list(self._channels)
        for key in keys:
            self.close_channel(key)


class PushService:
    """The sender's HTTP face, on ``host``'s free port, in daemon threads (one per request):

    * ``GET /info`` -> ``{"instance", "version"}``;
    * ``GET /metadata`` -> the tensors' names, dtype names and shapes (`WeightPushSender.metadata`);
    * ``POST /channel {"key", "world_size"}`` -> the init info for the server's
      ``/init_weight_transfer_engine`` (`WeightPushSender.open_channel`);
    * ``POST /push {"key", "version"}`` -> ``{"version": sent}``, once the broadcast is done;
    * ``POST /close {"key"}``.

    Errors answer 500 with ``{"error"}``. ``info_path`` (``RUN_DIR/weights/push.json``) says
    where it listens and which instance it is; written atomically, removed at close."""

    def __init__(self, sender: WeightPushSender, info_path: str | os.PathLike | None = None, host: str = "127.0.0.1"):
        self.sender = sender
        self.info_path = Path(info_path) if info_path is not None else None
        service = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet: the trainer's log is its steps
                pass

            def do_GET(self) -> None:  # noqa: N802
                self._answer(lambda _body: service.get(self.path))

            def do_POST(self) -> None:  # noqa: N802
                self._answer(lambda body: service.post(self.path, body))

            def _answer(self, handle) -> None:
                try:
                    length = int(self.headers.get("Content-Length") or 0)
                    body = json.loads(self.rfile.read(length)) if length else {}
                    status, answer = HTTPStatus.OK, handle(body)
                except _NoRoute as exc:
                    status, answer = HTTPStatus.NOT_FOUND, {"error": f"no route {exc}"}
                except Exception as exc:  # noqa: BLE001 - the caller gets it, in one line
                    status, answer = HTTPStatus.INTERNAL_SERVER_ERROR, {"error": f"{type(exc).__name__}: {exc}"}
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self._server = ThreadingHTTPServer((host, 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://{host}:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="orch-push-service", daemon=True)
        self._thread.start()
        if self.info_path is not None:
            tmp = self.info_path.with_name(f".{self.info_path.name}.{os.getpid()}")
            tmp.write_text(json.dumps({"url": self.url, "instance": sender.instance, "pid": os.getpid()}))
            os.replace(tmp, self.info_path)

    def get(self, path: str) -> Any:
        if path == "/metadata":
            return self.sender.metadata()
        raise _NoRoute(path)

    def post(self, path: str, body: dict[str, Any]) -> Any:
        if path == "/channel":
            return self.sender.open_channel(str(body["key"]), int(body["world_size"]))
        if path == "/push":
            return {"version": self.sender.push(str(body["key"]), int(body["version"]))}
        if path == "/close":
            self.sender.close_channel(str(body["key"]))
            return {}
        raise _NoRoute(path)

    def close(self) -> None:
        if self.info_path is not None:
            try:
                if json.loads(self.info_path.read_text()).get("instance") == self.sender.instance:
                    self.info_path.unlink()
            except (OSError, ValueError):
                pass
        self._server.shutdown()
        self._server.server_close()
        self.sender.close()
