"""model.path as a Hugging Face Hub id, found in the Hugging Face cache offline first: a cache
dir this test populates (the hub's own layout: refs/main -> snapshots/<commit>/) with the tiny
model; an id missing from it, offline, is one line naming the cache, exit 2, before the run dir."""

from __future__ import annotations

import http.server
import os
import shutil
import threading
from pathlib import Path

import pytest

from orchestrator.hf.model import model_dir_hash, prepare_model
from tests.support.cli import orch
from tests.support.runs import run_args

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
    result = orch(*run_args(tmp_path / "runs", "--set", "model.path=orch-test/missing"), env=env)
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


def test_an_id_the_hub_refuses_is_one_line_before_the_run_dir(tmp_path):
    env = dict(os.environ, HF_HUB_CACHE=str(tmp_path / "hub"), HF_HUB_OFFLINE="1")
    result = orch(*run_args(tmp_path / "runs", "--set", "model.path=org/model--v1"), env=env)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "orch: error: model.path 'org/model--v1' is neither a local dir nor a Hugging Face Hub id "
        "(Cannot have -- or .. in repo_id: 'org/model--v1'.)"
    ]
    assert not (tmp_path / "runs" / "r").exists()


class NoSuchRepo(http.server.BaseHTTPRequestHandler):
    """A Hub that has no repo at all (404 to every request), so no test reaches the network."""

    def do_GET(self):
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_HEAD = do_GET

    def log_message(self, *args):
        pass


def test_a_download_says_so_first_and_its_failure_is_one_line(tmp_path):
    """An id missing from the cache, online: one line saying where it downloads, before it does
    (here from a local server that has no repo: the failure is the usual one line)."""
    cache = tmp_path / "hub"
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NoSuchRepo)
    with server:
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
        env.update(HF_HUB_CACHE=str(cache), HF_ENDPOINT=f"http://127.0.0.1:{server.server_port}")
        try:
            result = orch(*run_args(tmp_path / "runs", "--set", "model.path=orch-test/not-here"), env=env)
        finally:
            server.shutdown()
            thread.join(timeout=10)
    assert result.returncode == 2, result.stderr
    assert (
        f"orch: downloading orch-test/not-here from the Hugging Face Hub into {cache}; "
        "set HF_HUB_OFFLINE=1 to refuse instead"
    ) in result.stdout.splitlines()
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"orch: error: model.path 'orch-test/not-here' is neither a local dir nor in the Hugging Face cache {cache}, "
        "and its download failed: "
    ), result.stderr
    assert not (tmp_path / "runs" / "r").exists()


def test_local_only_never_downloads(tmp_path, monkeypatch):
    from orchestrator.hf.model import ModelError, resolve_model_path

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    said = []
    with pytest.raises(ModelError, match=r"nor in the Hugging Face cache .* \(fetch it where there is a network"):
        resolve_model_path(Path("orch-test/not-here"), said.append, local_only=True)
    assert said == []
