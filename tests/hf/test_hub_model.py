"""model.path as a Hugging Face Hub id, found in the Hugging Face cache offline first: a cache
dir this test populates (the hub's own layout: refs/main -> snapshots/<commit>/) with the tiny
model; an id missing from it, offline, is one line naming the cache, exit 2, before the run dir."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from orchestrator.hf.model import model_dir_hash, prepare_model
from tests.support.cli import orch

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def populate_cache(cache: Path, repo_id: str, model_dir: Path) -> Path:
    """`model_dir` as the hub caches repo `repo_id`'s main revision; its snapshot dir."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / COMMIT
    shutil.copytree(model_dir, snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


def test_a_hub_id_is_its_snapshot_in_the_cache_offline(model_dir, tmp_path, monkeypatch):
    snapshot = populate_cache(tmp_path / "hub", "orch-test/tiny", model_dir)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    prepared = prepare_model(Path("orch-test/tiny"), tmp_path / "unused", env_gives_messages=True, lora_targets=None)
    assert prepared.path == snapshot
    assert prepared.sha256 == model_dir_hash(model_dir)


def test_a_local_dir_of_the_same_shape_wins(model_dir, tmp_path, monkeypatch):
    local = tmp_path / "orch-test" / "tiny"
    shutil.copytree(model_dir, local)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    prepared = prepare_model(Path("orch-test/tiny"), tmp_path / "unused", env_gives_messages=True, lora_targets=None)
    assert prepared.path == Path("orch-test/tiny")


def test_a_missing_id_offline_is_one_line_naming_the_cache_before_the_run_dir(tmp_path):
    cache = tmp_path / "hub"
    cache.mkdir()
    env = dict(os.environ, HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1")
    result = orch(
        "run", "--runs-dir", str(tmp_path / "runs"), "--name", "r", "--set", "model.path=orch-test/missing", env=env
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"orch: error: model.path 'orch-test/missing' is neither a local dir nor in the Hugging Face cache {cache} "
        "(HF_HUB_OFFLINE is set: fetch it where there is a network, `hf download orch-test/missing`)"
    ]
    assert not (tmp_path / "runs" / "r").exists()


@pytest.mark.parametrize("value", ["orch-test/missing/deeper", "/nowhere/at/all"])
def test_a_path_that_is_no_hub_id_is_still_a_missing_dir(tmp_path, value):
    from orchestrator.hf.model import ModelError

    with pytest.raises(ModelError, match="is not a directory"):
        prepare_model(Path(value), tmp_path, env_gives_messages=False, lora_targets=None)
