"""Damage never ships: bytes changed inside the token payloads of a run's log (where SQLite's
quick_check does not look) are caught by the payloads' checksums before anything is appended or
shipped, and `orch replay --check` names them as damage (docs/resume.md)."""

from __future__ import annotations

import random
import shutil
import sqlite3
from contextlib import closing
from pathlib import Path

import pytest

from eventlog import EventLog
from orchestrator.fold import fold_log
from orchestrator.rundir import batch_steps_on_disk, read_batch_file
from tests.support.cli import orch
from tests.support.runs import FAKE, sets

VOCAB = 1000
# Episodes of ~4,000 tokens: payloads of ~36 KiB, in their rows (not side files).
LONG_INLINE = [
    *FAKE,
    *sets("env.fake.prompt_tokens=200", "env.fake.min_tokens=3500", "env.fake.max_tokens=4000"),
    *sets(f"env.fake.vocab_size={VOCAB}", "batch.size=8", "rollout.group_size=4", "rollout.max_inflight=24"),
]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def long_run(tmp_path_factory) -> Path:
    runs = tmp_path_factory.mktemp("runs")
    keep = ("--set", "log.batch_files=keep")  # its copies' resumes check every batch file they ship
    done = orch("run", *LONG_INLINE, *keep, "--max-steps", "3", "--runs-dir", str(runs), "--name", "long")
    assert done.returncode == 0, done.stderr
    return runs / "long"


def _rows(db: Path) -> list[tuple]:
    with closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
        return conn.execute("select * from events order by seq").fetchall()


def _one_error_line(stderr: str) -> str:
    lines = [line for line in stderr.strip().splitlines() if not line.startswith("orch: warning:")]
    assert len(lines) == 1 and lines[0].startswith("orch: error:"), stderr
    return lines[0]


INPUTS = ("episode_completed", "version_published", "background_finalized")


def _crashed_where_most_are_held(run: Path, copy: Path) -> set[int]:
    """`copy`: `run` as a crash after the commit that left the most traces held (queued, never
    shipped) leaves it; return the seqs of those traces' episode_completed rows."""
    with EventLog.open_reader(run / "events.db") as log:
        rows = list(log.read_raw())
        ends = [seq for (seq, _ts, _kind, _data), after in zip(rows, rows[1:]) if after[2] in INPUTS]
        cut, state = max(
            ((seq, fold_log(log, at=seq, use_snapshots=False).state) for seq in ends), key=lambda c: len(c[1].traces)
        )
    shutil.copytree(run, copy)
    with closing(sqlite3.connect(copy / "events.db")) as conn:
        conn.execute("delete from events where seq > ?", (cut,))
        conn.execute("delete from snapshots")  # caches: a snapshot would hold the traces whole
        conn.commit()
        held = {
            seq
            for seq, episode in conn.execute(
                "select seq, data ->> '$.episode_id' from events"
                " where kind = 'episode_completed' and payload is not null"
            )
            if episode in state.traces
        }
    for step in batch_steps_on_disk(copy):  # written after the cut: a crash there would not have left them
        if step >= state.step:
            (copy / "batches" / f"step_{step}.safetensors").unlink()
    return held


def test_payload_bytes_changed_in_held_traces_are_refused_never_shipped_and_named_by_check(long_run, tmp_path):
    copy = tmp_path / "damaged"
    held = _crashed_where_most_are_held(long_run, copy)
    assert len(held) >= 4, "the crash leaves traces held"
    db = copy / "events.db"
    with EventLog.open_reader(db) as log:
        payloads = log.read_payloads(held)
    data = db.read_bytes()
    with open(db, "r+b") as f:  # 1 KiB inside each held trace's payload, where quick_check does not look
        for seq in sorted(held):
            f.seek(data.index(payloads[seq][8000:8064]))
            f.write(bytes([0xFF]) * 1024)
    before, batches = _rows(db), batch_steps_on_disk(copy)

    refused = orch("run", "--resume", str(copy), "--max-steps", "4")
    line = _one_error_line(refused.stderr)
    assert refused.returncode == 2 and f"seq {min(held)}: its data or payload fails its checksum" in line, line
    assert "--drop-damaged" in line and f"{len(held)} traces never shipped" in line
    assert _rows(db) == before and batch_steps_on_disk(copy) == batches, "nothing appended, nothing shipped"

    check = orch("replay", str(copy), "--check")
    assert check.returncode == 2 and f"seq {min(held)}: its data or payload fails its checksum" in check.stderr
    assert "deterministic" not in check.stdout + check.stderr

    dropped = orch("run", "--resume", str(copy), "--max-steps", "4", "--drop-damaged")
    assert dropped.returncode == 0, dropped.stderr
    for step in batch_steps_on_disk(copy):  # every token shipped is one the env sampled
        batch = read_batch_file((copy / "batches" / f"step_{step}.safetensors").read_bytes(), step)
        assert int(batch.token_ids.max()) < VOCAB and int(batch.token_ids.min()) >= 0


@pytest.mark.parametrize("seed", range(6))
def test_4_kib_at_a_random_offset_of_a_log_of_long_episodes_is_refused_before_any_append(long_run, tmp_path, seed):
    """Wherever the bytes land (page structure, payload of a trace shipped long ago, held trace),
    the resume refuses in one line and appends nothing, unless they changed no row at all."""
    copy = tmp_path / "damaged"
    shutil.copytree(long_run, copy)
    db = copy / "events.db"
    pristine = _rows(db)
    rng = random.Random(seed)
    with open(db, "r+b") as f:
        f.seek(rng.randrange(16384, db.stat().st_size - 4096))  # past the header page
        f.write(rng.randbytes(4096))
    batches = batch_steps_on_disk(copy)
    resumed = orch("run", "--resume", str(copy), "--max-steps", "4")
    if resumed.returncode == 0:  # the bytes fell where no row lives (free space of a page)
        assert _rows(db)[: len(pristine)] == pristine
        return
    line = _one_error_line(resumed.stderr)
    assert resumed.returncode == 2 and "is damaged" in line, line
    assert batch_steps_on_disk(copy) == batches, "nothing shipped"
    with closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
        try:
            count = conn.execute("select count(*) from events").fetchone()[0]
        except sqlite3.DatabaseError:
            return  # the page structure itself is damaged (quick_check's refusal)
    assert count == len(pristine), "nothing appended"
    check = orch("replay", str(copy), "--check")
    assert check.returncode == 2 and "damaged" in check.stderr, check.stdout + check.stderr
