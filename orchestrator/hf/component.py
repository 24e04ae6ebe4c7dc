"""The hf trainer as a run composes it: its model checked before anything runs, its
``trainer.json`` written, and the supervised process (one, or torchrun's N ranks) that trains.

`prepare_model` and `make_trainer` are the whole interface the runner uses (a registry entry
for the trainer kind `hf` needs nothing else); the returned trainer has the supervised-process
protocol of :mod:`orchestrator.shell.trainers` (start, run, batch_written, check, stop).
"""

from __future__ import annotations

import os
from pathlib import Path

from orchestrator.config import ConfigError, RunConfig
from orchestrator.hf.model import ModelError, PreparedModel
from orchestrator.shell.trainers import ProcessTrainer, Publish, TrainerFailed


def prepare_model(config: RunConfig, stored_hash: str | None = None) -> PreparedModel:
    """The run's model dir, checked (ConfigError: one line); on a resume, also the one the run
    started from (`stored_hash`, as kept in the log's meta)."""
    from orchestrator.envs.reverse_text import ReverseTextEnv
    from orchestrator.hf.model import prepare_model as prepare_model_dir

    lora = config.trainer.lora
    env = ReverseTextEnv(seed=config.seed, min_len=config.reverse_text.min_len, max_len=config.reverse_text.max_len)
    try:
        model = prepare_model_dir(
            config.model.path,
            config.runs_dir / ".cache",
            env_gives_messages=env.task(0).messages is not None,
            lora_targets=lora.target_modules if lora.rank else None,
        )
    except ModelError as err:
        raise ConfigError(str(err)) from None
    if stored_hash is not None and model.sha256 != stored_hash:
        raise ConfigError(
            f"the model dir {model.path} changed since the run started (its files' sha256 is {model.sha256[:12]}, "
            f"the run's was {stored_hash[:12]}); restore it, or start a new run"
        )
    return model


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
        keep_weights=max(3, config.off_policy.target_lag + 2),
        **config.trainer.model_dump(include=same),
    )
    try:
        write_trainer_config(run_dir, config_for_trainer)
    except OSError as err:  # e.g. a directory in its place: one line, like the trainer's own failures
        raise TrainerFailed(f"cannot write the trainer's config in {run_dir}: {err.strerror or err}") from err


def make_trainer(config: RunConfig, run_dir: Path, model: PreparedModel, publish: Publish) -> ProcessTrainer:
    """The supervised trainer process, its trainer.json written: torchrun's ranks for several
    ranks or nodes, else one `orch trainer` process."""
    write_trainer_json(config, run_dir, model)
    if config.trainer.nproc > 1 or config.trainer.nnodes > 1:
        from orchestrator.shell.torchrun_trainer import TorchrunTrainer

        return TorchrunTrainer(run_dir, publish, config.trainer)
    return ProcessTrainer(run_dir, publish)
