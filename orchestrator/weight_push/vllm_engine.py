"""vLLM's side of a weight push: a `WeightTransferEngine` (backend ``orch_gloo``) that each of a
vLLM server's workers runs, receiving the trainer's buckets over gloo and loading them through
vLLM's layerwise reload, as its NCCL engine does on GPUs. Imported only inside vLLM (the plugin,
:mod:`.vllm_plugin`, registers it by module path).

The server runs with ``--weight-transfer-config '{"backend": "orch_gloo"}'`` and
``VLLM_SERVER_DEV_MODE=1``; its routes then drive it: ``/init_weight_transfer_engine`` joins the
trainer's group (`OrchGlooInitInfo`), ``/start_weight_update``, ``/update_weights`` (the names,
dtypes and shapes: the worker receives while the trainer broadcasts), ``/finish_weight_update``.

Why not vLLM's own engines: they need CUDA (the NCCL engine's broadcast runs on CUDA streams;
the base class's ``update_weights`` ends in ``torch.accelerator.synchronize()``, which raises
"Cannot access accelerator device when none is available" on a CPU-only torch)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo

from orchestrator.weight_push.buckets import ParamSpec, plan_buckets, unpack
from orchestrator.weight_push.comm import Communicator, GlooCommunicator, client_store


@dataclass
class OrchGlooInitInfo(WeightTransferInitInfo):
    """Where the trainer's group is and this server's place in it. The workers take ranks
    ``rank_offset + worker rank`` (the trainer is rank 0); the bucket size is the trainer's,
    given here once so that both sides cut the same buckets."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    bucket_bytes: int
    timeout_s: float


@dataclass
class OrchGlooUpdateInfo(WeightTransferUpdateInfo):
    """One push: every tensor's name, dtype name and shape, in the order the trainer sends them."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(
                f"names, dtype_names and shapes differ in length: "
                f"{len(self.names)}, {len(self.dtype_names)}, {len(self.shapes)}"
            )


class OrchGlooWeightTransferEngine(WeightTransferEngine[OrchGlooInitInfo, OrchGlooUpdateInfo]):
    init_info_cls = OrchGlooInitInfo
    update_info_cls = OrchGlooUpdateInfo

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group: Communicator | None = None
        self.bucket_bytes = 0  # the trainer's, once joined (init_transfer_engine)

    def init_transfer_engine(self, init_info: OrchGlooInitInfo) -> None:
        """Join the trainer's group (a new one replaces the old: the trainer restarted, or a push
        failed and the group is not trusted any more). Waits for every rank, at most timeout_s."""
        self.shutdown()
        parallel = self.parallel_config
        rank = init_info.rank_offset + parallel.data_parallel_index * parallel.world_size + parallel.rank
        store = client_store(init_info.master_address, init_info.master_port, init_info.world_size, init_info.timeout_s)
        self.group = GlooCommunicator(store, rank, init_info.world_size, init_info.timeout_s, init_info.master_address)
        self.bucket_bytes = init_info.bucket_bytes

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict) -> None:
        """The base class's, without its ``torch.accelerator.synchronize()`` (none on the CPU;
        gloo's broadcast has returned when the bytes are in)."""
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: OrchGlooUpdateInfo) -> None:
        """Each bucket into a fresh buffer (the layerwise reload keeps the tensors it is given
        until their layer is whole), then into the model."""
        if self.group is None:
            raise RuntimeError("orch_gloo weight transfer is not initialised: POST /init_weight_transfer_engine first")
        specs = [
            ParamSpec.from_wire(name, dtype_name, shape)
            for name, dtype_name, shape in zip(update_info.names, update_info.dtype_names, update_info.shapes)
        ]
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        with disable_mtp_completeness_check():  # each bucket is part of the model, as with vLLM's NCCL engine
            for bucket in plan_buckets(specs, self.bucket_bytes):
                bucket_specs = [specs[i] for i in bucket]
                buffer = torch.empty(sum(s.nbytes for s in bucket_specs), dtype=torch.uint8, device=self.device)
                self.group.broadcast(buffer, src=0)
                self.model.load_weights(list(unpack(buffer, bucket_specs)))

    def shutdown(self) -> None:
        group, self.group = self.group, None
        if group is not None:
            group.close()
