"""The communicator a weight push broadcasts over: an interface (:class:`Communicator`: a
broadcast from the trainer, and close) and its gloo form (:class:`GlooCommunicator`), between
CPU processes, which the sender's gloo transport and orch's ``orch_gloo`` engine in vLLM's
workers use. (The NCCL transport uses vLLM's own communicator and packed broadcast:
orchestrator/weight_push/nccl.py.)

A group is made for one push channel (the trainer and one vLLM server's workers) and for
nothing else: a *stateless* group (its own TCPStore, no ``torch.distributed`` default group),
so it neither needs nor disturbs the trainer's own process group (DDP/FSDP ranks) or vLLM's.

Bounds: every gloo operation, the rendezvous included, gives up after the group's timeout and
raises, so a peer that is gone (a killed server, a killed trainer) costs at most that long; the
caller still runs collectives where its own wait is bounded (the sender in a thread it waits on
with a deadline), as a collective cannot be cancelled from outside."""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Protocol

import torch
from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

GROUP_PREFIX = "orch-weight-push"


class Communicator(Protocol):
    """A group in which rank 0 (the trainer) sends and every other rank (vLLM's workers) receives."""

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """``src``'s ``tensor`` into every other rank's ``tensor`` (same size and dtype); returns
        when this rank's part is done."""
        ...

    def close(self) -> None:
        """Release the group (idempotent); a collective running in another thread fails."""
        ...


def master_store(host: str, world_size: int, timeout_s: float) -> TCPStore:
    """The trainer's side of the rendezvous: a TCPStore listening on a free port of ``host``
    (``store.port``), returned at once; the workers connect to it, then every rank builds the
    group (`GlooCommunicator`), which waits for all of them."""
    return TCPStore(host, 0, world_size, is_master=True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


def client_store(host: str, port: int, world_size: int, timeout_s: float) -> TCPStore:
    """A worker's side of the rendezvous: the trainer's store (connecting waits at most ``timeout_s``)."""
    return TCPStore(host, port, world_size, is_master=False, timeout=timedelta(seconds=timeout_s))


def _device(trainer_host: str) -> ProcessGroupGloo.Device:
    """The interface gloo uses: ``GLOO_SOCKET_IFNAME`` if set (as torch reads it), else this
    machine's address on the route to the trainer (``trainer_host``: on the trainer, its own),
    which the other ranks reach by the same route; not the hostname's address, which may be
    one another machine cannot reach (127.0.1.1)."""
    if ifname := os.environ.get("GLOO_SOCKET_IFNAME"):
        return ProcessGroupGloo.create_device(interface=ifname.split(",")[0])
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((trainer_host, 9))  # UDP: sends nothing, picks the route
        return ProcessGroupGloo.create_device(hostname=probe.getsockname()[0])


class GlooCommunicator:
    """A stateless gloo group over ``store`` (`master_store` on rank 0, `client_store` elsewhere);
    built once every rank built it, within ``timeout_s``, which also bounds each broadcast."""

    def __init__(self, store: TCPStore, rank: int, world_size: int, timeout_s: float, trainer_host: str):
        self._store = store  # the group's rendezvous and its keys live as long as the group
        options = ProcessGroupGloo._Options()
        options._timeout = timedelta(seconds=timeout_s)
        options._devices = [_device(trainer_host)]
        self._group: ProcessGroupGloo | None = ProcessGroupGloo(
            PrefixStore(GROUP_PREFIX, store), rank, world_size, options
        )

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        group = self._group
        if group is None:
            raise RuntimeError("the weight-push group is closed")
        opts = torch.distributed.BroadcastOptions()
        opts.rootRank, opts.rootTensor = src, 0
        group.broadcast([tensor], opts).wait()

    def close(self) -> None:
        group, self._group = self._group, None
        if group is not None:
            try:
                group.abort()  # a broadcast blocked in another thread fails now, not at its timeout
            except RuntimeError:
                pass
