"""The hf trainer's factory: its model checked before anything runs, its ``trainer.json``
written, and the supervised process (one, or torchrun's N ranks) that trains.

The runner has the section (`HFTrainerConfig`, orchestrator/hf/component.py) prepare the model
before the run dir exists (the model's hash goes in the log's meta); its `build` calls
`make_trainer`, whose trainer is a :mod:`orchestrator.trainers.process` one (start, run,
batch_written, check, stop).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from orchestrator.contracts import BuildContext, ModelRequest, PreparedModel
from orchestrator.hf.config import HFTrainerSettings, TrainingSettings
from orchestrator.hf.model import ModelError
from orchestrator.placement import Placement
from orchestrator.trainers import TrainerFailed
from orchestrator.trainers.process import EarlyTrainer, ProcessTrainer

STEP_STOP_TIMEOUT_S = 20.0  # a placed trainer step: SIGTERM, then SIGKILL after this long


def prepare_model(request: ModelRequest, settings: TrainingSettings, stored_hash: str | None = None) -> PreparedModel:
    """The run's model dir, checked (ModelError: one line); on a resume, also the one the run
    started from (`stored_hash`, as kept in the log's meta); with the weight push, its largest
    tensor against the push's bucket size."""
    from orchestrator.hf.model import prepare_model as prepare_model_dir

    model = prepare_model_dir(
        request.path,
        request.cache_dir,
        env_gives_messages=request.env_gives_messages,
        lora_targets=settings.lora.target_modules if settings.lora.rank else None,
    )
    if request.weights_pushed:
        check_push_buckets(model.path, settings)
    if stored_hash is not None and model.sha256 != stored_hash:
        raise ModelError(
            f"the model dir {model.path} changed since the run started (its files' sha256 is {model.sha256[:12]}, "
            f"the run's was {stored_hash[:12]}); restore it, or start a new run"
        )
    return model


def check_push_buckets(model_dir: Path, settings: TrainingSettings) -> None:
    """ModelError unless every tensor of ``model_dir``'s safetensors files fits one push bucket
    (in the dtype it travels in: the push's, else float32, the trainer's). A bucket never splits
    a tensor, so a bucket smaller than one would be a size the push cannot keep. Files of
    another format are checked by the trainer when it first holds a version."""
    from safetensors import safe_open

    from orchestrator.weight_push import WIRE_ITEMSIZE

    itemsize = WIRE_ITEMSIZE[settings.push.dtype or "float32"]
    largest, name = 0, ""
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="numpy") as tensors:
            for key in tensors.keys():
                size = math.prod(tensors.get_slice(key).get_shape()) * itemsize
                if size > largest:
                    largest, name = size, key
    if largest > settings.push_bucket_bytes:
        raise ModelError(
            f"trainer.hf.push.bucket_mb {settings.push.bucket_mb:g} is below the model's largest tensor "
            f"({name}: {largest / (1 << 20):.1f} MiB as it travels); "
            f"set it to at least {math.ceil(largest / (1 << 20))}"
        )


def check_checkpoint(run_dir: Path, trained_steps: int) -> None:
    """The trainer's checkpoint, before a resume runs anything: without it the trainer would start
    again from the model and retrain every batch still on disk, silently. Every record of the zip
    archive `torch.save` writes is checked against its CRC-32 (`rundir.checkpoint_damage`), without
    torch. ModelError: one line naming the file and the way forward (docs/resume.md)."""
    from orchestrator import rundir
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
    why = rundir.checkpoint_damage(file)
    if why is not None:
        raise ModelError(
            f"the trainer's checkpoint {file} is {why}; the log says the trainer "
            f"trained up to step {trained_steps}; {way_forward}"
        )


def write_trainer_json(section: HFTrainerSettings, ctx: BuildContext, model: PreparedModel) -> None:
    from orchestrator.hf.config import TrainerConfig
    from orchestrator.hf.trainer import write_trainer_config

    settings = section.model_dump(include=set(TrainingSettings.model_fields))
    # The trainer may publish versions the log has not recorded yet (a crash): at least the ones a
    # resume may reload stay on disk.
    settings["keep_weights"] = max(section.keep_weights, ctx.kept_versions)
    if section.push.transport == "auto" and ctx.push_transport is not None:  # the servers orch launches decide
        settings["push"]["transport"] = ctx.push_transport
    placed = ctx.placement.trainer_host is not None  # its ranks on nodes the placement picks
    if placed and "host" not in section.push.model_fields_set:
        settings["push"]["host"] = ctx.placement.trainer_host  # where the servers reach its push service
    config_for_trainer = TrainerConfig(
        **settings,
        model_path=model.path.resolve(),
        model_hash=model.sha256,
        max_steps=ctx.max_steps,
        seed=ctx.seed,
        batch_wait_timeout_s=ctx.publish_timeout_s,
        # a rank on another node cannot watch orch's pid: its job step ends with orch instead
        parent_pid=None if placed else os.getpid(),
        push_weights=ctx.weights_pushed,
    )
    try:
        write_trainer_config(ctx.run_dir, config_for_trainer)
    except OSError as err:  # e.g. a directory in its place: one line, like the trainer's own failures
        raise TrainerFailed(f"cannot write the trainer's config in {ctx.run_dir}: {err.strerror or err}") from err


def make_trainer(section: HFTrainerSettings, ctx: BuildContext, model: PreparedModel) -> ProcessTrainer:
    """The supervised trainer process, its trainer.json written: torchrun's ranks for several
    ranks or nodes, else one `orch trainer` process."""
    write_trainer_json(section, ctx, model)
    # started_early: what HFTrainerConfig.start_early started, an EarlyTrainer (or None)
    return _process_trainer(section, Path(ctx.run_dir), ctx.max_restarts, ctx.started_early, ctx.placement)


def _process_trainer(
    section: HFTrainerSettings,
    run_dir: Path,
    max_restarts: int,
    started_early: EarlyTrainer | None,
    placement: Placement,
) -> ProcessTrainer:
    from orchestrator.hf.distributed import torchrun_command
    from orchestrator.trainers.torchrun import TorchrunTrainer

    if placement.rdzv_endpoint is not None:  # torchrun nodes as the placement's job step, under a guard
        from orchestrator.process_guard import guarded

        nodes = torchrun_command(
            run_dir, nproc=section.nproc, nnodes=placement.trainer_nodes, rdzv_endpoint=placement.rdzv_endpoint
        )
        step = guarded(placement.trainer_step(nodes), STEP_STOP_TIMEOUT_S)
        return TorchrunTrainer(run_dir, step, max_restarts=max_restarts)
    if section.nproc > 1 or section.nnodes > 1:
        return TorchrunTrainer(
            run_dir,
            torchrun_command(
                run_dir,
                nproc=section.nproc,
                nnodes=section.nnodes,
                node_rank=section.node_rank,
                rdzv_endpoint=section.rdzv_endpoint,
            ),
            max_restarts=max_restarts,
        )
    return ProcessTrainer(run_dir, max_restarts=max_restarts, early=started_early)
