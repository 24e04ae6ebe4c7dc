"""The trainer's ranks: one process, or N under torchrun with DDP or FSDP2.

The trainer is one class; a :class:`Ranks` tells it which rank it is and does the collective
parts: wrapping the model (``DistributedDataParallel`` or ``fully_shard``), a rank's share of a
batch, and the sums/maxes of its statistics. With one process every collective is the identity.

Sharding rule: every rank reads the whole batch and trains on samples ``rank::world``. The loss
is the single-process one, the mean over ALL sampled tokens of the batch: each rank divides its
token sum by the batch's count and multiplies by ``world`` (DDP and FSDP2 average gradients over
ranks), so the averaged gradient is the full-batch gradient up to float rounding, and clipping,
the lr schedule and AdamW see the same gradients on every rank.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from orchestrator.hf.batch import Batch


@dataclass
class Ranks:
    rank: int = 0
    world: int = 1
    device: torch.device = torch.device("cpu")
    backend: str = "none"

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls, backend: str, timeout_s: float) -> Ranks:
        """One process, or this rank of torchrun's (RANK/WORLD_SIZE/LOCAL_RANK), its process group
        initialised (`backend` auto: NCCL with CUDA, else gloo)."""
        if "WORLD_SIZE" not in os.environ:  # one process: on the GPU if there is one (and not gloo)
            on_gpu = backend != "gloo" and torch.cuda.is_available()
            return cls(device=torch.device("cuda", 0) if on_gpu else torch.device("cpu"))
        import torch.distributed as dist

        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if backend == "auto":
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        device = torch.device("cpu")
        if backend == "nccl":
            torch.cuda.set_device(local_rank)
            device = torch.device("cuda", local_rank)
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
        return cls(dist.get_rank(), dist.get_world_size(), device, backend)

    def close(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.destroy_process_group()

    def wrap(self, model: torch.nn.Module, strategy: str) -> torch.nn.Module:
        """The module the trainer runs forward/backward through (`model` itself with one rank)."""
        model.to(self.device)
        if self.world == 1:
            return model
        if strategy == "fsdp":
            from torch.distributed.fsdp import fully_shard

            for layer in transformer_layers(model):
                fully_shard(layer)
            fully_shard(model)
            return model
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids)

    @contextlib.contextmanager
    def gradient_sync(self, module: torch.nn.Module, sync: bool) -> Iterator[None]:
        """Backward passes inside reduce gradients across ranks only if `sync` (micro-batches
        accumulate locally and the last one reduces the sum)."""
        if self.world == 1 or sync:
            yield
        elif hasattr(module, "no_sync"):  # DDP
            with module.no_sync():
                yield
        else:  # FSDP2
            module.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                module.set_requires_gradient_sync(True)

    def shard(self, batch: Batch, micro_batch_size: int) -> list[Batch]:
        """This rank's samples (``rank::world``) in micro-batches of `micro_batch_size` (0: one).
        Every rank gets the same number of them, zero-weight rows where it has no samples left:
        under FSDP each forward pass is a collective."""
        index = torch.arange(self.rank, batch.ids.shape[0], self.world)
        most = -(-batch.ids.shape[0] // self.world)  # the largest share of a rank
        size = micro_batch_size or max(most, 1)
        return [batch.rows(index[i : i + size]) for i in range(0, max(most, 1), size)]

    def sum(self, values: list[float]) -> list[float]:
        return self._reduce(values, "SUM")

    def max(self, values: list[float]) -> list[float]:
        return self._reduce(values, "MAX")

    def _reduce(self, values: list[float], op: str) -> list[float]:
        if self.world == 1:
            return values
        import torch.distributed as dist

        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor, op=getattr(dist.ReduceOp, op))
        return tensor.tolist()

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()


def transformer_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder blocks FSDP2 shards one by one (transformers declares their class names in
    `_no_split_modules`); none found: the model is sharded as one unit."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    base = getattr(model, "get_base_model", lambda: model)()
    names |= set(getattr(base, "_no_split_modules", None) or [])
    return [m for m in model.modules() if type(m).__name__ in names]


def torchrun_command(
    run_dir: Path,
    *,
    nproc: int,
    nnodes: int = 1,
    node_rank: int | None = None,
    rdzv_endpoint: str | None = None,
    rdzv_id: str = "orch",
) -> list[str]:
    """``python -m torch.distributed.run ... -m orchestrator.cli trainer --run-dir RUN_DIR``:
    standalone on one node, else a c10d rendezvous at `rdzv_endpoint` shared by `nnodes` nodes."""
    where = (
        ["--standalone"]
        if nnodes == 1 and rdzv_endpoint is None
        else [
            f"--nnodes={nnodes}",
            *([f"--node-rank={node_rank}"] if node_rank is not None else []),  # None: the rendezvous numbers them
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={rdzv_endpoint}",
            f"--rdzv-id={rdzv_id}",
        ]
    )
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *where,
        f"--nproc-per-node={nproc}",
        "--max-restarts=0",
        "-m",
        "orchestrator.cli",
        "trainer",
        "--run-dir",
        str(run_dir),
    ]
