"""Long contexts: a trace's packed arrays round-trip through its event, the log and a
snapshot; a non-finite logprob is refused where a trace comes in; a long-context run resumes and
replays; a damaged payload is one line naming it."""

from __future__ import annotations

import os
import shutil
import sqlite3

import numpy as np
import orjson
import pytest

from eventlog import EventLog
from eventlog.sidefiles import SIDE_FILE_BYTES
from orchestrator.core import events as ev
from orchestrator.core.arrays import Tokens
from orchestrator.core.state import initial_state, state_bytes, state_from_bytes
from orchestrator.fold import fold_log
from orchestrator.rundir import batch_path, read_batch_file
from tests.support.cli import orch
from tests.support.runs import FAKE, sets


def _trace(n: int, episode_id: int = 7) -> tuple[ev.EpisodeCompleted, np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(n)
    ids = rng.integers(0, 151_936, n)
    mask = (rng.random(n) < 0.7).astype(np.uint8)
    logprobs = np.where(mask, -rng.random(n) * 20, 0.0).astype(np.float32)
    event = ev.EpisodeCompleted(
        episode_id=episode_id,
        group_id=2,
        ok=True,
        temperature=1.0,
        reward=0.5,
        tokens=Tokens.of(ids, mask, logprobs),
        policy_start=1,
        policy_end=2,
    )
    return event, ids, mask, logprobs


@pytest.mark.parametrize("n", [0, 1, 1_000_000])
def test_a_trace_round_trips_through_its_event_the_log_and_a_snapshot(tmp_path, n):
    event, ids, mask, logprobs = _trace(n)
    assert np.array_equal(np.frombuffer(event.token_ids, np.int32), ids)
    assert event.mask == mask.tobytes() and np.array_equal(np.frombuffer(event.logprobs, np.float32), logprobs)
    assert event.n_tokens == n and event.sampled_tokens == int(mask.sum())
    path = tmp_path / "events.db"
    with EventLog.create(path) as log:
        log.append_json(*ev.encode_event(event))
    with EventLog.open_reader(path) as log:
        [(seq, _ts, kind, data, payload)] = list(log.read_rows())
        assert ev.decode_event(kind, data, payload) == event
        assert log.read_payloads([seq]) == ({seq: payload} if n else {})
    db = sqlite3.connect(path)
    scalars = db.execute(
        "select json_extract(data, '$.tokens[0]'), json_extract(data, '$.tokens[1]'), length(payload) from events"
    ).fetchone()
    db.close()
    # Near 8 bytes a token: int32 id, float32 logprob, one bit of mask; no payload without tokens,
    # and a large one in a side file (its row holds a reference).
    size = 8 * n + (n + 7) // 8
    assert scalars == (n, int(mask.sum()), size if 0 < size <= SIDE_FILE_BYTES else None)
    assert [p.stat().st_size for p in (tmp_path / "events.db.payloads").glob("*")] == (
        [size] if size > SIDE_FILE_BYTES else []
    )
    state = initial_state(ev.CoreParams(env_ratios={"fake": 1.0}))
    state.traces[event.episode_id] = event
    assert state_from_bytes(state_bytes(state)).traces == {event.episode_id: event}


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), 1e39])
def test_a_non_finite_logprob_is_refused_where_a_trace_comes_in_in_one_line(bad):
    with pytest.raises(ValueError) as info:
        Tokens.of([1, 2, 3], [0, 1, 1], [0.0, -0.5, bad])
    assert "logprobs[2]" in str(info.value) and "finite" in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize(
    "field, value, fragment",
    [
        ("token_ids", [1, 2**31], "int32"),
        ("token_ids", [1.5, 2.0], "ints"),
        ("mask", [0, 2], "0 or 1"),
        ("logprobs", ["x", "y"], "floats"),
    ],
)
def test_arrays_of_the_wrong_kind_are_refused_in_one_line(field, value, fragment):
    fields = {"token_ids": [1, 2], "mask": [0, 1], "logprobs": [0.0, -1.0], field: value}
    with pytest.raises(ValueError) as info:
        Tokens.of(**fields)
    assert fragment in str(info.value) and "\n" not in str(info.value)


LONG = [
    *FAKE,
    *sets("env.fake.prompt_tokens=1024", "env.fake.min_tokens=4000", "env.fake.max_tokens=16000"),
    *sets("batch.size=8", "rollout.group_size=4", "rollout.max_inflight=24"),
    *sets("log.batch_files=keep"),  # the test reads trained batches back, and plays crashes with them
]


def test_a_long_context_run_resumes_and_replays_and_names_a_damaged_payload(tmp_path):
    run_dir = tmp_path / "long"
    first = orch("run", *LONG, "--max-steps", "2", "--runs-dir", str(tmp_path), "--name", "long")
    assert first.returncode == 0, first.stderr
    resumed = orch("run", "--resume", str(run_dir), "--max-steps", "4")
    assert resumed.returncode == 0, resumed.stderr
    check = orch("replay", str(run_dir), "--check")
    assert check.returncode == 0, check.stdout + check.stderr
    same = orch("replay", "--diff", str(run_dir), str(run_dir), "--level", "events")
    assert same.returncode == 0, same.stdout + same.stderr

    # A shipped sample's arrays, from the batch file, are the episode's in the log.
    batch = read_batch_file(batch_path(run_dir, 4).read_bytes(), 4)
    span = batch.tokens(0)
    shown = orch("replay", str(run_dir), "--episode", str(batch.sample_id[0]))
    assert shown.returncode == 0, shown.stderr
    [completion] = [orjson.loads(line) for line in shown.stdout.splitlines()]
    assert completion["token_ids"] == batch.token_ids[span].tolist() and len(completion["token_ids"]) >= 5024
    assert completion["mask"] == batch.mask[span].tolist()
    assert completion["logprobs"] == batch.logprobs[span].tolist()
    missing = orch("replay", str(run_dir), "--episode", "999999")
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1 and "episode 999999" in missing.stderr

    # A crash right after batch 3's commit (the log cut there): a copy resumes to the end; in
    # three others a held trace's payload is cut short in its row, damaged in its side file, or
    # its side file deleted, and each resume refuses in one line naming the seq (and the file),
    # shipping nothing.
    crashed = tmp_path / "crashed"
    shutil.copytree(run_dir, crashed)
    db = sqlite3.connect(crashed / "events.db")
    cut = db.execute("select seq from events where kind = 'batch_shipped' order by seq limit 1 offset 2").fetchone()[0]
    db.execute("delete from events where seq > ?", (cut,))
    db.execute("delete from snapshots")  # caches: a snapshot would hold the traces whole
    db.commit()
    db.close()
    for step in (4,):  # written after the cut: a crash there would not have left it
        batch_path(crashed, step).unlink()
    copies = {name: tmp_path / name for name in ("cut_row", "damaged_file", "deleted_file")}
    for copy in copies.values():
        shutil.copytree(crashed, copy)
    again = orch("run", "--resume", str(crashed), "--max-steps", "5")
    assert again.returncode == 0, again.stderr
    with EventLog.open_reader(crashed / "events.db") as log:
        state = fold_log(log, at=cut).state
    held = list(state.traces) + [x.trace.episode_id for xs in state.shipped_batches.values() for x in xs]
    db = sqlite3.connect(crashed / "events.db")
    rows = {
        ref is not None: (seq, ref)
        for seq, ref in db.execute(
            "select seq, payload_ref from events where kind = 'episode_completed' and seq <= ?"
            f" and json_extract(data, '$.episode_id') in ({','.join('?' * len(held))})",
            (cut, *held),
        )
    }
    db.close()
    assert set(rows) == {False, True}, "held traces with a payload in their row and in a side file"
    (inline_seq, _), (side_seq, ref) = rows[False], rows[True]
    db = sqlite3.connect(copies["cut_row"] / "events.db")
    db.execute("update events set payload = substr(payload, 1, 100) where seq = ?", (inline_seq,))
    db.commit()
    db.close()
    name, offset = ref.split(":")[:2]
    with open(f"{copies['damaged_file']}/events.db.payloads/{name}", "r+b") as f:
        f.seek(int(offset) + 10)
        f.write(b"\xff\xfe")
    os.unlink(f"{copies['deleted_file']}/events.db.payloads/{name}")
    expected = {
        "cut_row": (inline_seq, "fails its checksum"),
        "damaged_file": (side_seq, "damaged"),
        "deleted_file": (side_seq, "missing"),
    }
    for case, copy in copies.items():
        seq, fragment = expected[case]
        refused = orch("run", "--resume", str(copy), "--max-steps", "5")
        assert refused.returncode != 0, case
        lines = refused.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("orch: error:"), (case, refused.stderr)
        # A deleted file held other traces of its commit too: the first of them is named.
        assert (f"seq {seq}" in lines[0] or case == "deleted_file") and fragment in lines[0], (case, lines[0])
        if case != "cut_row":
            assert name in lines[0], lines[0]
        db = sqlite3.connect(copy / "events.db")
        assert db.execute("select max(seq) from events").fetchone()[0] == cut, case
        db.close()
    # The deleted file held a trace of a batch shipped and not yet trained, or only held traces
    # never shipped: the flag refuses the one (shipped history is never rewritten), drops the other.
    flagged = orch("run", "--resume", str(copies["deleted_file"]), "--max-steps", "5", "--drop-damaged")
    assert flagged.returncode == 0 or (
        flagged.returncode == 2 and "shipped and not yet trained" in _one_line(flagged.stderr)
    ), flagged.stderr
    # A crash right before batch 3's commit, and a held trace's piece of a side file damaged:
    # the refusal names the way forward, which drops it as a logged event and goes on to the end;
    # nothing ships twice.
    lost = tmp_path / "lost"
    shutil.copytree(run_dir, lost)
    db = sqlite3.connect(lost / "events.db")
    db.execute("delete from events where seq >= ?", (cut,))
    db.execute("delete from snapshots")
    db.commit()
    db.close()
    for step in (3, 4):
        batch_path(lost, step).unlink()
    with EventLog.open_reader(lost / "events.db") as log:
        held_ids = list(fold_log(log).state.traces)
    db = sqlite3.connect(lost / "events.db")
    held_seq, held_id, held_ref = db.execute(
        "select seq, data ->> '$.episode_id', payload_ref from events where kind = 'episode_completed'"
        f" and payload_ref is not null and data ->> '$.episode_id' in ({','.join('?' * len(held_ids))})",
        held_ids,
    ).fetchone()
    db.close()
    held_file, held_offset = held_ref.split(":")[:2]
    with open(f"{lost}/events.db.payloads/{held_file}", "r+b") as f:
        f.seek(int(held_offset) + 10)
        f.write(b"\xff\xfe")
    refused = orch("run", "--resume", str(lost), "--max-steps", "5")
    assert refused.returncode == 2 and f"seq {held_seq}" in refused.stderr and "--drop-damaged" in refused.stderr
    dropped = orch("run", "--resume", str(lost), "--max-steps", "5", "--drop-damaged")
    assert dropped.returncode == 0, dropped.stderr
    assert "--drop-damaged" in dropped.stderr and held_file in dropped.stderr
    db = sqlite3.connect(lost / "events.db")
    (damaged,) = db.execute(
        "select data ->> '$.damaged_traces' from events where kind = 'run_resumed' order by seq desc"
    ).fetchone()
    shipped = [
        t
        for (ids,) in db.execute("select data ->> '$.sample_ids' from events where kind = 'batch_shipped'")
        for t in orjson.loads(ids)
    ]
    db.close()
    assert orjson.loads(damaged) == [held_id]
    assert held_id not in shipped and len(shipped) == len(set(shipped))


def _one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("orch: error:"), stderr
    return lines[0]
