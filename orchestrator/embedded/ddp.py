"""The embedded trainer under ``torchrun`` (DDP): same files, same steps, N processes.

Launch (what ``orch run`` does with ``trainer.nproc = N > 1``)::

    python -m torch.distributed.run --standalone --nproc-per-node N --max-restarts 0 \\
        -m orchestrator.embedded.ddp --run-dir RUN_DIR [--backend auto|gloo|nccl]

``auto`` picks NCCL (one GPU per rank, ``cuda:LOCAL_RANK``) when CUDA is available, else gloo on
the CPU. Contract and results are those of the single-process trainer
(:mod:`orchestrator.embedded.trainer`, same ``trainer.json``):

* rank 0 alone warm-starts (or resumes), writes the checkpoint and publishes ``weights/step_N`` +
  ``STABLE``; after a barrier every rank loads that checkpoint, so all start from the same model
  and optimizer state;
* every rank reads the whole ``batches/step_N.json`` and trains on samples ``rank::world_size``
  (deterministic). The loss is the single-process one, the mean over *all* sampled tokens of
  the batch: each rank's token sum is scaled by ``world_size / total_tokens`` so that DDP's
  gradient average equals the full-batch gradient (up to float rounding). Gradient clipping, the
  lr schedule and Adam then see identical gradients on every rank, so replicas stay in sync;
* a rank with no sample (batch smaller than the world) still joins the gradient all-reduce with
  a zero-weight dummy row; a batch with no sampled token leaves the weights unchanged everywhere;
* each rank exits when the orchestrator (``parent_pid``) or its torchrun agent dies; an error on
  any rank makes torchrun stop the others and exit non-zero (the orchestrator sees the crash).
"""

from __future__ import annotations

import datetime
import os
import sys
import time
from pathlib import Path

import click
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from orchestrator import rundir as files
from orchestrator.embedded.policy import Policy, PolicyConfig, token_logprobs
from orchestrator.embedded.trainer import (
    Batch,
    StepStats,
    Trainer,
    TrainerConfig,
    TrainerError,
    exit_code_of,
    parse_batch,
    pg_loss,
    read_trainer_config,
    start_parent_watchdog,
)


def shard(batch: Batch, rank: int, world: int) -> tuple[Batch, bool]:
    """Samples ``rank::world`` of ``batch``; (a zero-weight dummy row, True) if none falls here."""
    idx = torch.arange(rank, batch.ids.shape[0], world)
    if len(idx) == 0:
        ids = batch.ids[:1]
        return Batch(batch.step, ids, torch.zeros_like(ids, dtype=torch.bool), torch.zeros(ids.shape),
                     torch.zeros(1), torch.ones(1), None), True
    return Batch(batch.step, batch.ids[idx], batch.mask[idx], batch.old_logprobs[idx], batch.advantages[idx],
                 batch.temperature[idx], None), False


class DDPTrainer:
    def __init__(self, run_dir: str | os.PathLike, config: TrainerConfig, *, rank: int, world: int,
                 device: torch.device):
        self.run_dir, self.config = Path(run_dir), config
        self.rank, self.world, self.device = rank, world, device
        # The single-process trainer does the file work (warm start, checkpoint, publish, waits).
        self.files = Trainer(run_dir, config, log=self.log)
        self.module: Policy | None = None
        self.model: DistributedDataParallel | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.step = -1

    def log(self, line: str) -> None:
        if self.rank == 0:
            print(line, flush=True)

    def init_or_resume(self) -> int:
        if self.rank == 0:
            self.files.init_or_resume()  # warm start or resume; publishes the current version
        dist.barrier()
        ck = torch.load(files.ckpt_dir(self.run_dir) / files.CKPT_FILE, map_location="cpu", weights_only=True)
        module = Policy(PolicyConfig.model_validate(ck["policy"]))
        module.load_state_dict(ck["model"])
        module.to(self.device)
        self.module = module
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        self.model = DistributedDataParallel(module, device_ids=device_ids)
        self.optimizer = torch.optim.Adam(module.parameters(), lr=self.config.lr)
        self.optimizer.load_state_dict(ck["optimizer"])
        self.step = int(ck["step"])
        self.files.model, self.files.optimizer, self.files.step = module, self.optimizer, self.step
        self.log(f"trainer ddp: {self.world} ranks ({dist.get_backend()}, {self.device.type}), at step {self.step}")
        return self.step

    def train_on_batch(self, batch: Batch) -> StepStats:
        """ONE optimizer step on the full ``batch`` (this rank's shard; gradients all-reduced)."""
        assert self.model is not None and self.module is not None and self.optimizer is not None
        t0 = time.perf_counter()
        total_tokens = batch.n_tokens  # the whole batch: every rank computes the same number
        n_samples = int(batch.ids.shape[0])
        module, dev = self.module, self.device
        stats = torch.zeros(3, device=dev)  # loss, clipfrac, kl: token-weighted sums
        ratio_max = torch.ones(1, device=dev)
        gnorm = 0.0
        if total_tokens == 0:
            self.log(f"trainer step={batch.step}: batch has no sampled tokens; weights unchanged")
        else:
            local, _dummy = shard(batch, self.rank, self.world)
            module.train()
            mask = local.mask.to(dev)
            new_lp = token_logprobs(self.model, local.ids.to(dev), local.temperature.to(dev))
            loss, info = pg_loss(new_lp, local.old_logprobs.to(dev), local.advantages.to(dev), mask,
                                 self.config.clip_eps)
            n_local = max(int(local.mask.sum()), 1)  # pg_loss divides by this (clamped at 1)
            # DDP averages gradients over ranks: this scaling makes the average the gradient of
            # sum(all token losses) / total_tokens, the single-process loss.
            scaled = loss * (n_local * self.world / total_tokens)
            self.optimizer.zero_grad(set_to_none=True)
            scaled.backward()
            gnorm = float(torch.nn.utils.clip_grad_norm_(module.parameters(), self.config.grad_clip))
            for group in self.optimizer.param_groups:
                group["lr"] = self.files.lr_at(batch.step)
            self.optimizer.step()
            module.eval()
            n_real = int(local.mask.sum())
            stats += torch.tensor([float(loss.detach()) * n_real, info["clipfrac"] * n_real, info["kl"] * n_real],
                                  device=dev)
            ratio_max.fill_(info["ratio_max"])
            dist.all_reduce(stats)
            dist.all_reduce(ratio_max, op=dist.ReduceOp.MAX)
        loss_v, clipfrac, kl = (stats / max(total_tokens, 1)).tolist()
        adv = batch.advantages
        return StepStats(
            step=batch.step, loss=loss_v, adv_mean=float(adv.mean()) if n_samples else 0.0,
            adv_abs_mean=float(adv.abs().mean()) if n_samples else 0.0, samples=n_samples, tokens=total_tokens,
            clipfrac=clipfrac, kl=kl, ratio_max=float(ratio_max.item()), grad_norm=gnorm,
            reward_mean=(sum(batch.rewards) / len(batch.rewards)) if batch.rewards else None,
            wait_s=0.0, train_s=time.perf_counter() - t0,
        )

    def train_step(self, step: int) -> StepStats:
        if step != self.step + 1:
            raise TrainerError(f"trainer is at step {self.step}; cannot train step {step}")
        t0 = time.perf_counter()
        path = files.batch_path(self.run_dir, step)
        self.files.step = self.step
        self.files.wait_for(path)
        wait_s = time.perf_counter() - t0
        stats = self.train_on_batch(parse_batch(path.read_bytes(), step, where=str(path)))
        stats.wait_s = wait_s
        self.step = step
        if self.rank == 0:
            self.files.step = step
            self.files.save_checkpoint()
            self.files.publish(step, stats.metrics(self.files.lr_at(step)))
        return stats

    def run(self) -> None:
        self.init_or_resume()
        if self.step >= self.config.max_steps:
            self.log(f"trainer: already at step {self.step} >= max_steps {self.config.max_steps}; done")
            return
        for step in range(self.step + 1, self.config.max_steps + 1):
            stats = self.train_step(step)
            self.log(stats.line() + f" ranks={self.world}")
        dist.barrier()  # the last publication is done before any rank reports success
        self.log(f"trainer done: {self.config.max_steps} steps on {self.world} ranks")


def pick_backend(backend: str) -> tuple[str, torch.device]:
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        return backend, torch.device("cuda", local_rank)
    return backend, torch.device("cpu")


def run_ddp_trainer(run_dir: str | os.PathLike, backend: str = "auto") -> int:
    """One rank of the DDP trainer (RANK/WORLD_SIZE/... from torchrun); returns the exit code."""
    rank = int(os.environ.get("RANK", "0"))

    def body() -> None:
        nonlocal backend
        if "WORLD_SIZE" not in os.environ:
            raise TrainerError("run me under torchrun (python -m torch.distributed.run ...): WORLD_SIZE is not set")
        config = read_trainer_config(run_dir)
        if config.parent_pid is not None:
            start_parent_watchdog(config.parent_pid)
        start_parent_watchdog(os.getppid())  # the torchrun agent: never outlive it
        torch.set_num_threads(config.num_threads)
        backend, device = pick_backend(backend)
        timeout = datetime.timedelta(seconds=config.batch_wait_timeout_s + 120)
        dist.init_process_group(backend, timeout=timeout)
        try:
            DDPTrainer(run_dir, config, rank=dist.get_rank(), world=dist.get_world_size(), device=device).run()
        finally:
            dist.destroy_process_group()

    return exit_code_of(body, where=f"[rank {rank}] ")


@click.command("trainer-ddp")
@click.option("--run-dir", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="run directory holding trainer.json, batches/ and weights/")
@click.option("--backend", type=click.Choice(["auto", "gloo", "nccl"]), default="auto", show_default=True,
              help="process group backend (auto: nccl when CUDA is available, else gloo)")
def ddp_trainer_command(run_dir: Path, backend: str) -> None:
    """One rank of the embedded trainer under torchrun (DDP)."""
    sys.exit(run_ddp_trainer(run_dir, backend))


if __name__ == "__main__":  # torchrun ... -m orchestrator.embedded.ddp --run-dir DIR
    ddp_trainer_command()
