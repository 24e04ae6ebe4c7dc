"""How a version travels from the trainer to one server's workers: a :class:`Transport`, chosen
by name (`transport_named`; the trainer's ``trainer.hf.push.transport``), so the sender does not care
what moves the bytes. Each transport pairs a communicator on the trainer with a vLLM
weight-transfer backend on the servers (``--weight-transfer-config '{"backend": ...}'``):

* ``gloo`` (:class:`GlooTransport`): between CPU processes, with orch's ``orch_gloo`` engine
  (:mod:`.vllm_engine`) on the servers; a version is held packed in host memory;
* ``nccl`` (:class:`orchestrator.weight_push.nccl.NcclTransport`): between GPUs, with vLLM's own
  ``nccl`` engine on the servers; a version is held on the trainer's GPU.

Both cut a version into the same buckets (:mod:`.buckets`: vLLM's packed-broadcast rule), so a
bucket size is one setting whatever moves them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from orchestrator.weight_push.buckets import ParamSpec, pack, plan_buckets
from orchestrator.weight_push.comm import Communicator, GlooCommunicator, master_store


class Transport(Protocol):
    """One kind of group between the trainer (rank 0) and a server's workers (ranks 1..), cutting
    versions into buckets of its ``bucket_bytes``."""

    bucket_bytes: int

    def hold(self, specs: Sequence[ParamSpec], tensors: Sequence[torch.Tensor]) -> Any:
        """A version as this transport sends it: a copy of ``tensors`` (training goes on while a
        push reads it), each in its spec's dtype."""
        ...

    def open(self, host: str, world_size: int, timeout_s: float) -> tuple[dict[str, Any], Callable[[], Any]]:
        """A new group's rendezvous: the init info its servers' ``/init_weight_transfer_engine``
        takes, and what builds the trainer's side of the group, which has a ``close`` (it blocks
        until every rank joined: run in the channel's thread; gloo gives up after
        ``timeout_s``)."""
        ...

    def send(self, group: Any, held: Any) -> None:
        """Broadcast a held version on ``group`` (what ``open`` built), bucket after bucket."""
        ...


class GlooTransport:
    def __init__(self, bucket_bytes: int):
        self.bucket_bytes = bucket_bytes

    def hold(self, specs: Sequence[ParamSpec], tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Packed into its buckets once, in host memory (where gloo sends from), rather than at
        every push to every server."""
        return [
            pack([tensors[i].to(device="cpu", dtype=specs[i].dtype) for i in bucket])
            for bucket in plan_buckets(specs, self.bucket_bytes)
        ]

    def open(self, host: str, world_size: int, timeout_s: float) -> tuple[dict[str, Any], Callable[[], Communicator]]:
        store = master_store(host, world_size, timeout_s)
        init_info = {
            "master_address": host,
            "master_port": store.port,
            "rank_offset": 1,
            "world_size": world_size,
            "bucket_bytes": self.bucket_bytes,
            "timeout_s": timeout_s,
        }
        return init_info, lambda: GlooCommunicator(store, 0, world_size, timeout_s, host)

    def send(self, group: Communicator, held: list[torch.Tensor]) -> None:
        for buffer in held:
            group.broadcast(buffer, src=0)


def transport_named(name: str, bucket_bytes: int) -> Transport:
    """``gloo`` or ``nccl`` (this trainer's CUDA device: torch's current one)."""
    if name == "gloo":
        return GlooTransport(bucket_bytes)
    if name == "nccl":
        from orchestrator.weight_push.nccl import NcclTransport  # vLLM's NCCL: only on GPUs

        return NcclTransport(bucket_bytes)
    raise ValueError(f"unknown weight-push transport {name!r}: gloo or nccl")
