"""The push between GPUs: the trainer's side of vLLM's own ``nccl`` weight-transfer backend (the
servers run ``--weight-transfer-config '{"backend": "nccl"}'``). The trainer is rank 0 of a
stateless NCCL group with one server's workers, made and used with vLLM's own helpers
(``nccl_common.trainer_init``, ``packed_nccl_broadcast_producer``), so both ends pack and cut
the buckets with the same code. Imported only where a trainer pushes over NCCL: it needs CUDA
and vLLM in the trainer's Python.

Bounds: NCCL's rendezvous and broadcasts have no timeout of their own; the sender runs them in
the channel's thread and gives up on them after ``push_timeout_s`` (the group is destroyed, the
thread left to NCCL), and vLLM ends a server whose receive failed."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo, trainer_init, worker_init_payload
from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

from orchestrator.urls import free_port
from orchestrator.weight_push.buckets import ParamSpec

NUM_BUFFERS = 2  # double buffering: one bucket packs while the other is on the wire (vLLM's default)


class NcclGroup:
    """vLLM's PyNcclCommunicator as a `Communicator`, on this process's CUDA stream."""

    def __init__(self, communicator: Any, world_size: int):
        self.communicator, self.rank, self.world_size = communicator, 0, world_size

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        self.communicator.broadcast(tensor, src=src, stream=torch.cuda.current_stream())

    def close(self) -> None:
        communicator, self.communicator = self.communicator, None
        if communicator is not None:
            communicator.destroy()


class NcclTransport:
    backend: ClassVar[str] = "nccl"

    def __init__(self, bucket_bytes: int):
        if not torch.cuda.is_available():
            raise RuntimeError("trainer.hf.push.transport 'nccl' needs CUDA in the trainer process; use 'gloo'")
        self.bucket_bytes = bucket_bytes
        self.device = torch.device("cuda", torch.cuda.current_device())

    def hold(self, specs: Sequence[ParamSpec], tensors: Sequence[torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        """A copy on the trainer's GPU, where NCCL sends from (vLLM packs it as it sends)."""
        return [
            (spec.name, t.to(device=self.device, dtype=spec.dtype, copy=True))
            for spec, t in zip(specs, tensors, strict=True)
        ]

    def tensors(
        self, held: list[tuple[str, torch.Tensor]], specs: Sequence[ParamSpec]
    ) -> list[tuple[str, torch.Tensor]]:
        return list(held)

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
            return NcclGroup(trainer_init(rendezvous), world_size)

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
