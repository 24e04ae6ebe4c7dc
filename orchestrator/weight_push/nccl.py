"""The push between GPUs: the trainer's side of vLLM's own ``nccl`` weight-transfer backend (the
servers run ``--weight-transfer-config '{"backend": "nccl"}'``). The trainer is rank 0 of a
stateless NCCL group with one server's workers, made and used with vLLM's own helpers
(``nccl_common.trainer_init``, ``packed_nccl_broadcast_producer``), so both ends pack and cut
the buckets with the same code. Imported only where a trainer pushes over NCCL: it needs CUDA
and vLLM in the trainer's Python.

Bounds: NCCL's rendezvous and broadcasts have no timeout of their own; the sender runs them in
the channel's thread and gives up on them after ``push_timeout_s`` (the group is destroyed, the
thread left to NCCL). A server's workers whose trainer died mid-push stay in their receive: the
load's calls time out, and a server orch launched is restarted as stuck in its load
(docs/vllm.md, "When a server dies or hangs"). Not run here (no GPU): `make gpu-check` is its
check."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo, trainer_init, worker_init_payload
from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

from orchestrator.urls import free_port
from orchestrator.weight_push.buckets import ParamSpec

NUM_BUFFERS = 2  # double buffering: one bucket packs while the other is on the wire (vLLM's default)


class NcclGroup:
    """vLLM's PyNcclCommunicator, as the sender's channel holds and closes it (vLLM's packed
    producer broadcasts on it)."""

    def __init__(self, communicator: Any):
        self.communicator = communicator

    def close(self) -> None:
        communicator, self.communicator = self.communicator, None
        if communicator is not None:
            communicator.destroy()


class NcclTransport:
    def __init__(self, bucket_bytes: int):
        if not torch.cuda.is_available():
            raise RuntimeError("trainer.hf.push.transport 'nccl' needs CUDA in the trainer process; use 'gloo'")
        self.bucket_bytes = bucket_bytes
        self.device = torch.device("cuda", torch.cuda.current_device())

    def hold(self, specs: Sequence[ParamSpec], tensors: Sequence[torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        """A copy on the trainer's GPU, where NCCL sends from (vLLM packs it as it sends)."""
        held = [
            (spec.name, t.to(device=self.device, dtype=spec.dtype, copy=True))
            for spec, t in zip(specs, tensors, strict=True)
        ]
        torch.cuda.current_stream().synchronize()  # vLLM's producer reads them on streams of its own
        return held

    def open(self, host: str, world_size: int, timeout_s: float) -> tuple[dict[str, Any], Callable[[], NcclGroup]]:
        port = free_port(host)
        worker = NCCLWeightTransferInitInfo(
            master_address=host,
            master_port=port,
            rank_offset=1,
            world_size=world_size,
            packed=True,
            packed_buffer_size_bytes=self.bucket_bytes,
            packed_num_buffers=NUM_BUFFERS,
        )

        def make_group() -> NcclGroup:
            torch.cuda.set_device(self.device)  # the channel's thread
            rendezvous = {"master_address": host, "master_port": port, "world_size": world_size}
            return NcclGroup(trainer_init(rendezvous))

        return worker_init_payload(worker), make_group

    def send(self, group: NcclGroup, held: list[tuple[str, torch.Tensor]]) -> None:
        torch.cuda.set_device(self.device)
        packed_nccl_broadcast_producer(
            iterator=iter(held),
            group=group.communicator,
            src=0,
            post_iter_func=lambda item: item[1],
            buffer_size_bytes=self.bucket_bytes,
            num_buffers=NUM_BUFFERS,
        )
        torch.cuda.current_stream().synchronize()
