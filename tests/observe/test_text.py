"""Readable completions: `orch replay RUN --episode ID --text` and the `text` column of `orch
export`'s episodes, decoded with the run's tokenizer (a fake run whose token ids lie in the tiny
model's byte vocabulary, the tokenizer where an hf trainer publishes it)."""

from __future__ import annotations

import shutil
import sqlite3
from contextlib import closing

import orjson
import pytest

from eventlog import EventLog
from eventlog.fileformat import PAGE_SIZE
from orchestrator.hf.tiny_model import build_tokenizer
from orchestrator.observe.text import Decoder, NoTokenizer, tokenizer_dir
from tests.support.cli import orch
from tests.support.logs import events
from tests.support.runs import fake_run_args, sets


@pytest.fixture(scope="module")
def fake_run(tmp_path_factory):
    """A fake run of ids < 256 (the tiny tokenizer's bytes), its tokenizer in weights/step_0."""
    runs = tmp_path_factory.mktemp("runs")
    result = orch(*fake_run_args(runs, "r", *sets("env.fake.vocab_size=256", "batch.size=16"), steps=2))
    assert result.returncode == 0, result.stderr
    build_tokenizer().save_pretrained(runs / "r" / "weights" / "step_0")
    return runs / "r"


def sampled_and_prompt(episode: dict) -> tuple[list[int], list[int]]:
    first = episode["mask"].index(1)
    return [t for t, m in zip(episode["token_ids"], episode["mask"]) if m], episode["token_ids"][:first]


def test_replay_episode_text_is_the_run_tokenizers_decoding(fake_run):
    tokenizer = build_tokenizer()
    episode = next(e for _, e in events(fake_run, "episode_completed") if e["ok"])
    result = orch("replay", str(fake_run), "--episode", str(episode["episode_id"]), "--text")
    assert result.returncode == 0, result.stderr
    (line,) = result.stdout.splitlines()
    shown = orjson.loads(line)
    sampled, prompt = sampled_and_prompt(episode)
    assert shown["completion_text"] == tokenizer.decode(sampled, skip_special_tokens=True) != ""
    assert shown["prompt_text"] == tokenizer.decode(prompt, skip_special_tokens=True)
    assert shown["token_ids"] == episode["token_ids"]  # the arrays stay


def test_export_has_each_completions_text_unless_opted_out(fake_run, tmp_path):
    tokenizer = build_tokenizer()
    result = orch("export", str(fake_run), str(tmp_path / "a.db"))
    assert result.returncode == 0, result.stderr
    texts = dict(sqlite3.connect(tmp_path / "a.db").execute("SELECT id, text FROM episodes WHERE ok = 1"))
    completed = [e for _, e in events(fake_run, "episode_completed") if e["ok"]]
    assert texts and len(texts) == len({e["episode_id"] for e in completed})
    for episode in completed:
        if episode["episode_id"] in texts:
            expected = tokenizer.decode(sampled_and_prompt(episode)[0], skip_special_tokens=True)
            assert texts[episode["episode_id"]] == expected
    result = orch("export", str(fake_run), str(tmp_path / "b.db"), "--no-text")
    assert result.returncode == 0 and result.stderr == ""
    assert sqlite3.connect(tmp_path / "b.db").execute("SELECT count(text) FROM episodes").fetchone() == (0,)


def test_without_a_tokenizer_replay_refuses_and_export_says_so(fake_run, tmp_path):
    bare = tmp_path / "bare"
    shutil.copytree(fake_run, bare, ignore=shutil.ignore_patterns("weights"))
    episode_id = str(next(e for _, e in events(fake_run, "episode_completed") if e["ok"])["episode_id"])
    result = orch("replay", str(bare), "--episode", episode_id, "--text")
    assert result.returncode == 2
    looked = f"looked in {bare / 'weights'}/step_N"
    assert result.stderr.strip().splitlines() == [
        f"orch: error: no tokenizer of {bare} found ({looked}); give one with --tokenizer DIR"
    ]
    tokenizer = str(fake_run / "weights" / "step_0")
    given = orch("replay", str(bare), "--episode", episode_id, "--text", "--tokenizer", tokenizer)
    assert given.returncode == 0 and "completion_text" in given.stdout
    exported = orch("export", str(bare), str(tmp_path / "c.db"))
    assert exported.returncode == 0
    assert "the episodes' text column is left NULL: no tokenizer of" in exported.stderr
    assert orch("replay", str(bare), "--text").returncode == 2


def test_a_tokenizer_that_raises_anything_is_one_line(tmp_path):
    """Damaged tokenizer files raise what transformers raises (a KeyError here): NoTokenizer."""
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / "tokenizer_config.json").write_text('{"tokenizer_class": "PreTrainedTokenizerFast"}')
    (damaged / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "Nope"}}')
    with pytest.raises(NoTokenizer) as err:
        Decoder(damaged)
    assert str(err.value) == f"the tokenizer in {damaged} does not load (KeyError: 'added_tokens')"


def test_a_stored_hub_id_is_its_snapshot_in_the_cache_never_downloaded(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    config = orjson.dumps({"model": {"path": "orch-test/tiny"}})
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # local files only all the same
    with pytest.raises(NoTokenizer, match="model.path orch-test/tiny"):
        tokenizer_dir(run_dir, config)
    repo = tmp_path / "hub" / "models--orch-test--tiny"
    snapshot = repo / "snapshots" / ("0" * 40)
    build_tokenizer().save_pretrained(snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    assert tokenizer_dir(run_dir, config) == snapshot
    with pytest.raises(NoTokenizer, match="model.path org/model--v1"):  # no id the Hub takes
        tokenizer_dir(run_dir, orjson.dumps({"model": {"path": "org/model--v1"}}))


def test_export_of_a_damaged_payload_leaves_its_text_null_and_says_so(fake_run, tmp_path):
    seq, episode = next((seq, e) for seq, e in events(fake_run, "episode_completed") if e["ok"])
    with closing(sqlite3.connect(fake_run / "events.db")) as conn:
        (payload,) = conn.execute("SELECT payload FROM events WHERE seq = ?", (seq,)).fetchone()
    damaged = tmp_path / "damaged"
    shutil.copytree(fake_run, damaged)
    with closing(sqlite3.connect(damaged / "events.db")) as conn:
        conn.execute("UPDATE events SET payload = ? WHERE seq = ?", (bytes(len(payload)), seq))
        conn.commit()
    result = orch("export", str(damaged), str(tmp_path / "d.db"))
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"orch: note: 1 episodes' text is left NULL: their payloads are damaged or dropped (the first: "
        f"{damaged / 'events.db'} is damaged: seq {seq}: its data or payload fails its checksum (row_hash "
        + result.stderr.split("(row_hash ", 1)[1].strip()
    ]
    texts = dict(sqlite3.connect(tmp_path / "d.db").execute("SELECT id, text FROM episodes WHERE ok = 1"))
    assert texts[episode["episode_id"]] is None
    assert sum(text is not None for text in texts.values()) == len(texts) - 1


def test_export_of_a_run_that_dropped_its_token_arrays_leaves_their_texts_null_and_says_so(fake_run, tmp_path):
    dropped = tmp_path / "dropped"
    shutil.copytree(fake_run, dropped)
    with EventLog.open(dropped / "events.db") as log:
        assert log.drop_payloads(r.seq for r in log.read(kinds=("episode_completed",)))
    result = orch("export", str(dropped), str(tmp_path / "d.db"))
    assert result.returncode == 0, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert "text is left NULL: their payloads are damaged or dropped" in line and "its payload was dropped" in line
    texts = dict(sqlite3.connect(tmp_path / "d.db").execute("SELECT id, text FROM episodes WHERE ok = 1"))
    assert texts and all(text is None for text in texts.values())


def test_export_of_a_damaged_table_is_one_line(fake_run, tmp_path):
    """A page of the events table SQLite itself finds malformed, met mid-read."""
    damaged = tmp_path / "damaged"
    shutil.copytree(fake_run, damaged)
    db = damaged / "events.db"
    data = db.read_bytes()
    page = data.index(b'"episode_id"') // PAGE_SIZE * PAGE_SIZE
    db.write_bytes(data[:page] + b"\xff" * PAGE_SIZE + data[page + PAGE_SIZE :])
    result = orch("export", str(damaged), str(tmp_path / "d.db"))
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("orch: error: ") and str(damaged / "events.db") in line, result.stderr
    assert not (tmp_path / "d.db").exists()
