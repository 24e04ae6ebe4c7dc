"""TensorBoard and W&B (offline) sinks from real runs: what they hold is the log's rows, and a resumed
run writes no step twice."""

from __future__ import annotations

import os
import struct

import orjson
import pytest
from click.testing import CliRunner

from eventlog import EventLog
from orchestrator.observe import sinks
from orchestrator.observe.rows import log_rows
from tests.observe.util import run_fake
from tests.support.cli import orch
from tests.support.runs import fake_run_args, sets


def tensorboard_points(log_dir) -> list[tuple[str, int, float, float]]:
    """(tag, step, value, wall time) of every scalar in a TensorBoard log dir."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util.tensor_util import make_ndarray

    acc = EventAccumulator(str(log_dir), size_guidance={"tensors": 0})
    acc.Reload()
    return sorted(
        (tag, e.step, float(make_ndarray(e.tensor_proto).item()), e.wall_time)
        for tag in acc.Tags()["tensors"]
        for e in acc.Tensors(tag)
    )


def log_points(run_dir) -> list[tuple[str, int, float, float]]:
    with EventLog.open_reader(run_dir / "events.db") as log:
        return sorted((name, step, float(value), ts) for _, ts, (step, name, value) in log_rows(log))


def test_tensorboard_holds_the_logs_rows(runs):
    got, want = tensorboard_points(runs["a"] / "tensorboard"), log_points(runs["a"])
    assert [p[:2] for p in got] == [p[:2] for p in want]  # every row, once
    for (_, _, value, wall), (_, _, logged, ts) in zip(got, want):
        assert value == pytest.approx(logged, rel=1e-6)  # TensorBoard keeps float32
        assert wall == pytest.approx(ts)


def wandb_history(wandb_dir) -> list[dict]:
    """The history rows of every offline W&B run file under `wandb_dir` (the .wandb files are
    LevelDB-style logs of protobuf `Record`s after a 7-byte header)."""
    from wandb.proto import wandb_internal_pb2 as pb

    rows = []
    for path in sorted(wandb_dir.glob("wandb/offline-run-*/run-*.wandb")):
        data, pos, block, chunks = path.read_bytes(), 7, 32768, b""
        while pos + 7 <= len(data):
            if block - pos % block < 7:  # a block's tail too short for a header is padding
                pos += block - pos % block
                continue
            length, kind = struct.unpack_from("<HB", data, pos + 4)
            chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
            if kind == 0:
                break
            chunks += chunk
            if kind in (1, 4):  # a whole record, or a record's last part
                record = pb.Record()
                record.ParseFromString(chunks)
                chunks = b""
                if record.WhichOneof("record_type") == "history":
                    rows.append(
                        {
                            item.key or "/".join(item.nested_key): orjson.loads(item.value_json)
                            for item in record.history.item
                        }
                        | {"_file": path.parent.name}
                    )
    return rows


def test_a_resumed_run_continues_its_sinks_and_writes_no_step_twice(tmp_path):
    wandb_dir = tmp_path / "wandb-dir"
    wandb_dir.mkdir()
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_DIR": str(wandb_dir), "WANDB_SILENT": "true"}
    on = ["--set", "metrics.tensorboard=true", "--set", "metrics.wandb.project=orch-test"]
    run_dir = run_fake(tmp_path, "r", *on, steps=4, env=env)
    result = orch("run", "--resume", str(run_dir), "--max-steps", "8", env=env)
    assert result.returncode == 0, result.stderr

    want = log_points(run_dir)
    assert {step for name, step, *_ in want if name == "reward/mean"} == set(range(1, 9))
    assert [p[:2] for p in tensorboard_points(run_dir / "tensorboard")] == [p[:2] for p in want]

    history = wandb_history(wandb_dir)
    run_id = sinks.wandb_run_id(_meta(run_dir)["config_hash"])
    files = {row["_file"] for row in history}
    assert len(files) == 2 and all(name.endswith(run_id) for name in files)  # one W&B run, continued
    logged = sorted(
        (name, row["step"])
        for row in history
        for name in row
        if name not in ("step", "_file", "_step", "_timestamp", "_runtime")
    )
    assert logged == [p[:2] for p in want]  # every row once, across the run and its resume
    cursors = orjson.loads((run_dir / sinks.CURSORS_FILE).read_bytes())
    assert set(cursors.values()) == {_meta(run_dir)["last_seq"]}


def _meta(run_dir) -> dict:
    with EventLog.open_reader(run_dir / "events.db") as log:
        return {**log.meta, "last_seq": log.last_seq}


def test_a_sink_that_is_not_installed_is_one_line_before_anything_runs(tmp_path, monkeypatch):
    from orchestrator import cli

    real = sinks.importlib.util.find_spec
    monkeypatch.setattr(sinks.importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    result = CliRunner().invoke(
        cli.main,
        fake_run_args(tmp_path / "runs", None, *sets("metrics.wandb.project=p")),
    )
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        "orch: error: metrics.wandb needs the wandb package: pip install 'orch[wandb]'"
    ]
    assert not (tmp_path / "runs").exists()


def test_sinks_are_operational_config_a_resume_may_turn_on_or_off():
    from orchestrator.config import load_config, meaning_changes

    stored = load_config(overrides=['envs={"fake": 1}', "trainer.kind=fake"])
    assert stored.metrics.wandb is None and stored.metrics.tensorboard is None  # off by default
    on = load_config(
        base=stored.model_dump(mode="json"),
        overrides=["metrics.tensorboard=true", "metrics.wandb.project=p", "metrics.wandb.mode=offline"],
    )
    assert on.metrics.tensorboard.log_dir is None and on.metrics.wandb.mode == "offline"
    assert meaning_changes(stored, on) == [] and meaning_changes(on, stored) == []
    assert meaning_changes(stored, on.model_copy(update={"seed": 5})) == ["seed"]


def test_a_sink_that_cannot_start_is_one_line_with_the_resume_hint(tmp_path):
    (tmp_path / "afile").write_text("")
    result = orch(
        *fake_run_args(tmp_path, "r", *sets(f"metrics.tensorboard.log_dir={tmp_path / 'afile' / 'tb'}"), steps=2)
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        f"orch: error: metrics.tensorboard: cannot start: NotADirectoryError: [Errno 20] Not a directory: "
        f"'{tmp_path / 'afile' / 'tb'}' (continue it with `orch run --resume {tmp_path / 'r'}` once fixed)"
    ]


def wandb_tables(wandb_dir, key: str) -> dict[int, dict]:
    """step -> the W&B table logged under `key` at that step (offline: a JSON file of the run's
    media, which the history row names under `key/path`)."""
    tables = {}
    for row in wandb_history(wandb_dir):
        if f"{key}/path" in row:
            run_files = wandb_dir / "wandb" / row["_file"] / "files"
            tables[row["step"]] = orjson.loads((run_files / row[f"{key}/path"]).read_bytes())
    return tables


def tensorboard_texts(log_dir) -> dict[int, list[list[str]]]:
    """step -> the `samples` text table of a TensorBoard log dir."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util.tensor_util import make_ndarray

    accumulator = EventAccumulator(str(log_dir), size_guidance={"tensors": 0})
    accumulator.Reload()
    return {
        e.step: [[cell.decode() for cell in row] for row in make_ndarray(e.tensor_proto)]
        for e in accumulator.Tensors("samples")
    }


def test_the_sinks_show_each_steps_first_samples_as_the_runs_tokenizer_decodes_them(tmp_path):
    """A fake run whose token ids lie in the tiny tokenizer's bytes, that tokenizer its model; then
    resumed with a new TensorBoard dir, which gets every step's at once."""
    from orchestrator.core.events import episode_of
    from orchestrator.hf.tiny_model import build_tokenizer
    from tests.support.logs import events

    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    wandb_dir = tmp_path / "wandb-dir"
    wandb_dir.mkdir()
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_DIR": str(wandb_dir), "WANDB_SILENT": "true"}
    on = sets(
        "metrics.tensorboard=true",
        "metrics.wandb.project=orch-test",
        "metrics.samples_per_step=3",
        "env.fake.vocab_size=256",
        f"model.path={tmp_path / 'tokenizer'}",
    )
    run_dir = run_fake(tmp_path, "r", *on, steps=3, env=env)
    elsewhere = sets(f"metrics.tensorboard.log_dir={tmp_path / 'tb-resumed'}")
    result = orch("run", "--resume", str(run_dir), "--max-steps", "4", *elsewhere, env=env)
    assert result.returncode == 0, result.stderr

    completed = {e["episode_id"]: e for _, e in events(run_dir, "episode_completed") if e["ok"]}
    want = {}
    for _, shipped in events(run_dir, "batch_shipped"):
        rows = []
        for sample_id in shipped["sample_ids"][:3]:
            episode = completed[episode_of(sample_id)]
            first = episode["mask"].index(1)
            sampled = [t for t, m in zip(episode["token_ids"], episode["mask"]) if m]
            prompt = tokenizer.decode(episode["token_ids"][:first], skip_special_tokens=True)
            completion = tokenizer.decode(sampled, skip_special_tokens=True)
            rows.append([str(sample_id), f"{episode['reward']:g}", prompt, completion])
        want[shipped["step"]] = rows
    assert sorted(want) == [1, 2, 3, 4] and all(len(rows) == 3 for rows in want.values())
    tables = {step: [list(sinks.SAMPLE_COLUMNS), *rows] for step, rows in want.items()}
    assert tensorboard_texts(run_dir / "tensorboard") == {step: tables[step] for step in (1, 2, 3)}
    assert tensorboard_texts(tmp_path / "tb-resumed") == tables

    tables = wandb_tables(wandb_dir, "samples")
    assert {step: table["data"] for step, table in tables.items()} == want
    assert all(table["columns"] == list(sinks.SAMPLE_COLUMNS) for table in tables.values())
