"""On-disk contracts between the orchestrator, its samplers and its trainers: the one place for the
run directory's paths, the batch file schema, the weights directories and the STABLE marker.

Layout of a run directory (``RUN_DIR``)::

    events.db                    the event log (eventlog; its -wal and -shm files beside it)
    trainer.json                 the trainer's config (orchestrator.hf.config.TrainerConfig), written by the
                                 orchestrator before it spawns the trainer
    trainer.log                  the trainer process's output (appended to across resumes)
    batches/step_N.safetensors   batch N (binary; written atomically by the orchestrator; removed once
                                 version N is published, unless log.batch_files = "keep")
    weights/step_N/              the policy after training on batches 1..N (step_0 = the model as loaded)
        full fine-tuning:        an HF model dir: config.json, model.safetensors, generation_config.json,
                                 tokenizer files (save_pretrained, safe_serialization)
        LoRA:                    a PEFT adapter dir: adapter_config.json, adapter_model.safetensors
                                 (every version is one; step_0's B matrices are zero)
        metrics.json             (N >= 1) the trainer's figures of step N (TRAINER_METRICS; the hf trainer
                                 adds "step", "clipfrac", "ratio_max", "samples", "samples_per_episode",
                                 "adv_abs_mean", "reward_mean" (when every sample has a reward), "wait_s",
                                 "ranks"),
                                 written before STABLE
        STABLE                   marker, written (tmp + fsync + rename) only after the files above
    weights/.versions.lock       flock'd: shared while a server loads a version, exclusive while the
                                 trainer prunes old ones (`hold_versions`), so no dir is deleted under a reload
    trainer_ckpt/ckpt.pt         trainer checkpoint (trained weights + AdamW state + step + model hash),
                                 replaced atomically

Batch file (format ``orchestrator.core.batch.BATCH_FORMAT``): a safetensors file of flat arrays, laid out and built by
``orchestrator.core.batch`` (its canonical bytes are what the log's sha256 covers). Per sample:
``sample_id``, ``group_id``, ``policy_start``, ``lag`` (int64), ``advantage``, ``temperature``
(float64), optionally ``reward`` (float64: averaged into the hf trainer's step line); per token,
sample i's at ``offsets[i]:offsets[i+1]``: ``token_ids`` (int32, prompt + completion), ``mask``
(uint8, 1 = sampled token), ``logprobs`` (float32, the sampler's, 0.0 where mask is 0); the env
names in its metadata.

``read_batch_file`` reads one for every trainer, without a copy (its arrays are views of the
bytes it is given), checking its layout and step; a trainer checks the values against its model.

Every writer here is atomic: write a temp sibling, fsync it, ``os.replace``/``os.rename`` it into
place, fsync the parent directory. A reader therefore sees either nothing or the whole file/dir.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import shutil
import uuid
import zipfile
from pathlib import Path

from orchestrator.core.batch import BatchArrays, decode_batch

EVENTS_DB = "events.db"
BATCH_SUFFIX = ".safetensors"
TRAINER_LOG = "trainer.log"
STABLE = "STABLE"
# The files of a weights dir of `orch serve`'s own policy (orchestrator.serve.policy).
MODEL_FILE = "model.pt"
POLICY_FILE = "policy.json"
CKPT_FILE = "ckpt.pt"
METRICS_FILE = "metrics.json"
# The figures every trainer reports for a step, in `weights/step_N/metrics.json` (a flat JSON
# object of finite numbers; a trainer may add its own): `mismatch_kl` is KL(sampler || trainer)
# over the sampled tokens, estimated from the batch's sampling logprobs and the trainer's own
# before its update; `entropy` is the mean entropy (nats) of the trainer's distribution at those
# tokens' positions.
TRAINER_METRICS = ("loss", "grad_norm", "entropy", "mismatch_kl", "tokens", "learning_rate", "step_time_s")
TRAINER_CONFIG_FILE = "trainer.json"
_TMP_MARK = ".tmp-"


# ---------------------------------------------------------------------------------------- paths
def events_db(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / EVENTS_DB


def trainer_log(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / TRAINER_LOG


def batches_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "batches"


def batch_path(run_dir: str | os.PathLike, step: int) -> Path:
    return batches_dir(run_dir) / f"step_{step}{BATCH_SUFFIX}"


def batch_steps_on_disk(run_dir: str | os.PathLike) -> list[int]:
    """The steps of the batch files in the run dir (written ones, not temporary siblings)."""
    names = (path.name for path in batches_dir(run_dir).glob(f"step_*{BATCH_SUFFIX}"))
    steps = (name[5 : -len(BATCH_SUFFIX)] for name in names)
    return [int(step) for step in steps if step.isdigit()]


def weights_root(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "weights"


def weights_dir(run_dir: str | os.PathLike, version: int) -> Path:
    return weights_root(run_dir) / f"step_{version}"


def ckpt_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "trainer_ckpt"


def is_stable(wdir: str | os.PathLike) -> bool:
    """True once ``wdir`` holds complete weights (its STABLE marker exists)."""
    return (Path(wdir) / STABLE).is_file()


def stable_versions(run_dir: str | os.PathLike) -> list[int]:
    """Published (STABLE) weight versions, ascending."""
    root = weights_root(run_dir)
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        if p.name.startswith("step_") and p.name[5:].isdigit() and is_stable(p):
            out.append(int(p.name[5:]))
    return sorted(out)


# ------------------------------------------------------------------------------------ atomicity
def fsync_dir(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _tmp_sibling(path: Path) -> Path:
    return path.with_name(f".{path.name}{_TMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}")


def atomic_write_bytes(path: str | os.PathLike, data: bytes, *, durable: bool = True) -> None:
    """Write ``data`` to ``path`` atomically (tmp sibling + fsync + rename + fsync dir).

    ``durable=False`` skips both fsyncs, for files that can be rebuilt from the event log: readers
    still never see a partial file (the rename is atomic), and one that a power loss leaves
    missing or partial is re-written on resume.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_sibling(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)


def atomic_write_dir(dest: str | os.PathLike, write_files) -> Path:
    """Create directory ``dest`` atomically.

    ``write_files(tmp_dir)`` fills a temp sibling directory; every regular file in it is then
    fsynced, the temp dir is renamed to ``dest`` and the parent is fsynced. ``dest`` must not exist
    (raises FileExistsError): published directories are immutable.
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    if dest.exists():
        raise FileExistsError(f"{dest} already exists")
    tmp = _tmp_sibling(dest)
    tmp.mkdir()
    try:
        write_files(tmp)
        for p in tmp.iterdir():
            if p.is_file():
                with open(p, "rb+") as f:
                    os.fsync(f.fileno())
        fsync_dir(tmp)
        os.rename(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(dest.parent)
    return dest


def read_metrics(wdir: str | os.PathLike) -> tuple[dict[str, int | float] | None, list[str]]:
    """The figures in ``wdir/metrics.json`` (None without one) and the names of the entries left
    out because they are not finite numbers (or the file is not a JSON object: ``["*"]``)."""
    try:
        raw = (Path(wdir) / METRICS_FILE).read_bytes()
    except FileNotFoundError:
        return None, []
    try:  # the stdlib's parser: it reads the NaN and Infinity a trainer's json.dump writes (refused below)
        doc = json.loads(raw)
    except ValueError:
        doc = None
    if not isinstance(doc, dict):
        return None, ["*"]
    kept, refused = {}, []
    for name, value in doc.items():
        if type(value) in (int, float) and math.isfinite(value):
            kept[name] = value
        else:
            refused.append(name)
    return kept, refused


def mark_stable(wdir: str | os.PathLike) -> None:
    """Write the STABLE marker inside ``wdir`` (atomic). Call only after the weights are complete."""
    atomic_write_bytes(Path(wdir) / STABLE, b"ok\n")


def remove_dir_safely(wdir: str | os.PathLike) -> None:
    """Unpublish then delete: STABLE goes first, then the dir is renamed aside and removed, so no
    reader ever sees a STABLE dir with missing files."""
    wdir = Path(wdir)
    (wdir / STABLE).unlink(missing_ok=True)
    trash = _tmp_sibling(wdir)
    try:
        os.rename(wdir, trash)
    except FileNotFoundError:
        return
    shutil.rmtree(trash, ignore_errors=True)


VERSIONS_LOCK = ".versions.lock"


def hold_versions(wdir: str | os.PathLike, *, exclusive: bool) -> int | None:
    """Try to lock the weight versions beside `wdir` (its parent's `VERSIONS_LOCK`): shared for
    a server's load of one (none is deleted until it ends), exclusive for the trainer's prune.
    Never blocks: None if the other side holds it; otherwise an fd for `release_versions`, or
    -1 where no lock file can be made (weights outside a writable run dir: nothing prunes them).
    A flock dies with its process: a crashed loader or pruner leaves nothing held."""
    try:
        fd = os.open(Path(wdir).parent / VERSIONS_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        return -1
    try:
        fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def release_versions(fd: int) -> None:
    if fd >= 0:
        os.close(fd)  # the lock goes with its last descriptor


def clean_tmp(directory: str | os.PathLike) -> None:
    """Remove leftovers of interrupted atomic writes (``.NAME.tmp-*``) in ``directory``."""
    directory = Path(directory)
    if not directory.is_dir():
        return
    for p in directory.iterdir():
        if p.name.startswith(".") and _TMP_MARK in p.name:
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------- batches
class BatchFileError(ValueError):
    """A batch file that does not follow the schema; the message names the file and the problem."""


def read_batch_file(raw: bytes | memoryview, expected_step: int, where: str = "batch") -> BatchArrays:
    """The arrays of a batch file's bytes (views, no copy), checked against the format and the
    step; BatchFileError (one line, naming `where`) otherwise."""
    try:
        batch = decode_batch(raw)
    except ValueError as err:
        raise BatchFileError(f"{where}: {err}") from None
    if batch.step != expected_step:
        raise BatchFileError(f"{where}: step must be {expected_step}, got {batch.step}")
    return batch


def sample_tag(where: str, batch: BatchArrays, index: int) -> str:
    """How an error names a sample of a batch file."""
    return f"{where}: sample {index} (sample_id {int(batch.sample_id[index])})"


def checkpoint_damage(file: Path) -> str | None:
    """What is wrong with the checkpoint file, or None if it is whole. `torch.save` writes a zip
    archive whose every record carries its CRC-32, written with it: each is read and checked
    (a truncation loses the archive's directory, at its end, first), without torch."""
    try:
        with zipfile.ZipFile(file) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError) as err:
        return f"damaged or truncated ({err})"
    except Exception as err:  # noqa: BLE001 - zipfile raises what a damaged record makes of it
        return f"damaged ({type(err).__name__}: {err})"
    return None if bad is None else f"damaged (its record {bad} fails its CRC-32)"
