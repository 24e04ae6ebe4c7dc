"""The hf trainer as a run composes it: its model checked before anything runs, its
``trainer.json`` written, and the supervised process (one, or torchrun's N ranks) that trains.

The runner calls `prepare_model` before the run dir exists (the model's hash goes in the log's
meta); the registry's `HFTrainerConfig.build` (orchestrator/hf/config.py) calls `make_trainer`,
whose trainer is a :mod:`orchestrator.trainers.process` one (start, run, batch_written, check, stop).
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrator.hf.model import ModelError, PreparedModel
from orchestrator.trainers import TrainerFailed
from orchestrator.trainers.process import ProcessTrainer

if TYPE_CHECKING:
    from orchestrator.config import RunConfig


def prepare_model(config: RunConfig, stored_hash: str | None = None) -> PreparedModel:
    """The run's model dir, checked (ModelError: one line); on a resume, also the one the run
    started from (`stored_hash`, as kept in the log's meta)."""
    from orchestrator.hf.model import prepare_model as prepare_model_dir

    lora = config.trainer.hf.lora
    model = prepare_model_dir(
        config.model.path,
        config.runs_dir / ".cache",
        env_gives_messages=any(env.gives_messages for env in config.env_components().values()),
        lora_targets=lora.target_modules if lora.rank else None,
    )
    if stored_hash is not None and model.sha256 != stored_hash:
        raise ModelError(
            f"the model dir {model.path} changed since the run started (its files' sha256 is {model.sha256[:12]}, "
            f"the run's was {stored_hash[:12]}); restore it, or start a new run"
        )
    return model


def check_checkpoint(run_dir: Path, trained_steps: int) -> None:
    """The trainer's checkpoint, before a resume runs anything: without it the trainer would start
    again from the model and retrain every batch still on disk, silently. Read as the zip archive
    `torch.save` writes (its directory, at the end, is the first thing a truncation loses), without
    torch. ModelError: one line naming the file and the way forward (docs/resume.md)."""
    from orchestrator.hf.checkpoint import path as ckpt_path

    if trained_steps <= 0:
        return  # nothing trained yet: a missing checkpoint is the model as loaded
    file = ckpt_path(run_dir)
    way_forward = "restore it from a backup, or start a new run (docs/resume.md)"
    if not file.is_file():
        raise ModelError(
            f"the trainer's checkpoint {file} is missing, but the log says the trainer trained up to "
            f"step {trained_steps}; {way_forward}"
        )
    try:
        with zipfile.ZipFile(file) as archive:
            archive.infolist()
    except (zipfile.BadZipFile, OSError) as err:
        raise ModelError(
            f"the trainer's checkpoint {file} is damaged or truncated ({err}); the log says the trainer "
            f"trained up to step {trained_steps}; {way_forward}"
        ) from None


def write_trainer_json(config: RunConfig, run_dir: Path, model: PreparedModel) -> None:
    from orchestrator.hf.trainer import TrainerConfig, write_trainer_config

    # The trainer section's fields the trainer process reads under the same names.
    same = {"lr", "lr_warmup_steps", "clip_eps", "lora", "micro_batch_size", "distributed", "backend"}
    config_for_trainer = TrainerConfig(
        model_path=model.path.resolve(),
        model_hash=model.sha256,
        max_steps=config.max_steps,
        seed=config.seed,
        batch_wait_timeout_s=config.trainer.publish_timeout_s,
        parent_pid=os.getpid(),
        # The trainer may publish up to target_lag + 1 versions the log has not recorded yet (a
        # crash); a resume reloads the newest recorded one, which must still be on disk.
        keep_weights=max(config.trainer.hf.keep_weights, config.off_policy.target_lag + 2),
        **config.trainer.hf.model_dump(include=same),
    )
    try:
        write_trainer_config(run_dir, config_for_trainer)
    except OSError as err:  # e.g. a directory in its place: one line, like the trainer's own failures
        raise TrainerFailed(f"cannot write the trainer's config in {run_dir}: {err.strerror or err}") from err


def make_trainer(config: RunConfig, run_dir: Path, model: PreparedModel) -> ProcessTrainer:
    """The supervised trainer process, its trainer.json written: torchrun's ranks for several
    ranks or nodes, else one `orch trainer` process."""
    write_trainer_json(config, run_dir, model)
    trainer = _process_trainer(config, run_dir)
    trainer.max_restarts = config.trainer.max_restarts
    return trainer


def _process_trainer(config: RunConfig, run_dir: Path) -> ProcessTrainer:
    section = config.trainer.hf
    if section.nproc > 1 or section.nnodes > 1:
        from orchestrator.hf.distributed import torchrun_command
        from orchestrator.trainers.torchrun import TorchrunTrainer

        return TorchrunTrainer(
            run_dir,
            torchrun_command(
                run_dir,
                nproc=section.nproc,
                nnodes=section.nnodes,
                node_rank=section.node_rank,
                rdzv_endpoint=section.rdzv_endpoint,
            ),
        )
    return ProcessTrainer(run_dir)
