"""Atomic batch and weight files: no partial file is ever visible; STABLE only after the weights."""

import os

import pytest

from orchestrator import rundir as files
from orchestrator.core.batch import BatchSample, encode_batch
from orchestrator.hf.publish import prune, publish
from orchestrator.hf.sampler import load_version
from orchestrator.hf.tiny_model import build_untrained
from tests.support.batches import write_batch_file

MODEL, TOKENIZER = build_untrained(seed=0)


def _publish(run_dir, version):
    return publish(run_dir, version, MODEL, TOKENIZER, MODEL.state_dict(), {"step": version})


def test_atomic_write_bytes_is_complete_and_fsynced_before_it_becomes_visible(tmp_path, monkeypatch):
    target = tmp_path / "batches" / "step_1.safetensors"
    sample = {"token_ids": list(range(10000)), "mask": [1] * 10000, "logprobs": [-1.0] * 10000}
    sample |= {"advantage": 0.5, "temperature": 1.0}
    payload = encode_batch(1, [BatchSample(0, 0, "", policy_start=0, lag=0, **sample)])  # whose sha256 the log holds
    fsynced = []
    real_fsync, real_replace = os.fsync, os.replace
    seen = {}

    def fsync(fd):
        fsynced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real_fsync(fd)

    def replace(src, dst):
        seen["target_existed"] = os.path.exists(dst)
        seen["tmp_complete"] = open(src, "rb").read() == payload
        seen["tmp_fsynced"] = str(src) in fsynced
        return real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    write_batch_file(tmp_path, 1, [sample])
    assert seen == {"target_existed": False, "tmp_complete": True, "tmp_fsynced": True}
    assert str(target.parent) in fsynced  # the directory entry is durable too
    assert target.read_bytes() == payload
    assert os.listdir(target.parent) == ["step_1.safetensors"]


def test_a_rebuildable_file_is_written_atomically_without_fsync(tmp_path, monkeypatch):
    target = tmp_path / "batches" / "step_2.safetensors"
    seen = {}
    real_replace = os.replace

    def replace(src, dst):
        seen["tmp_complete"] = open(src, "rb").read() == b"payload"
        return real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", lambda fd: seen.setdefault("fsynced", fd))
    monkeypatch.setattr(os, "replace", replace)
    files.atomic_write_bytes(target, b"payload", durable=False)
    assert seen == {"tmp_complete": True}  # renamed once complete, never fsynced
    assert target.read_bytes() == b"payload" and os.listdir(target.parent) == ["step_2.safetensors"]


def test_failed_write_leaves_nothing_visible(tmp_path, monkeypatch):
    def boom(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        write_batch_file(tmp_path, 1, [])
    assert os.listdir(tmp_path / "batches") == []


def test_weights_dir_appears_whole_and_stable_comes_last(tmp_path, monkeypatch):
    wdir = files.weights_dir(tmp_path, 0)
    events = []
    real_rename, real_mark = os.rename, files.mark_stable
    contents = [
        "chat_template.jinja",
        "config.json",
        "generation_config.json",
        files.METRICS_FILE,
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]

    def rename(src, dst):
        if str(dst) == str(wdir):
            events.append(("rename", os.path.exists(dst), sorted(os.listdir(src))))
            load_version(src, tmp_path)  # the temp dir is complete before it gets its public name
        return real_rename(src, dst)

    def mark(d):
        events.append(("stable", sorted(os.listdir(d))))
        load_version(d, tmp_path)  # weights complete and loadable before STABLE
        return real_mark(d)

    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(files, "mark_stable", mark)
    _publish(tmp_path, 0)
    assert events == [("rename", False, contents), ("stable", contents)]
    assert files.is_stable(wdir) and files.stable_versions(tmp_path) == [0]
    _publish(tmp_path, 0)  # idempotent: an already published version is left alone
    assert len(events) == 2


def test_incomplete_leftover_is_replaced_and_tmp_files_cleaned(tmp_path):
    wdir = files.weights_dir(tmp_path, 0)
    wdir.mkdir(parents=True)
    (wdir / "model.safetensors").write_bytes(b"partial")
    junk = files.weights_root(tmp_path) / ".step_1.tmp-123-abcdef01"
    junk.mkdir()
    files.clean_tmp(files.weights_root(tmp_path))
    assert not junk.exists()
    _publish(tmp_path, 0)
    load_version(wdir, tmp_path)
    assert files.is_stable(wdir)


def test_old_weight_dirs_are_pruned_keeping_the_newest(tmp_path):
    for v in range(6):
        _publish(tmp_path, v)
        prune(tmp_path, v, keep=3)
        assert files.stable_versions(tmp_path) == list(range(max(0, v - 2), v + 1))
    names = ["step_3", "step_4", "step_5", files.VERSIONS_LOCK]  # the lock a prune takes
    assert sorted(p.name for p in files.weights_root(tmp_path).iterdir()) == sorted(names)


def test_a_prune_waits_while_a_server_loads_a_version(tmp_path):
    for v in range(4):
        _publish(tmp_path, v)
    loading = files.hold_versions(files.weights_dir(tmp_path, 0), exclusive=False)  # a reload of step_0
    assert loading is not None and loading >= 0
    try:
        assert not prune(tmp_path, 3, keep=2) and files.stable_versions(tmp_path) == [0, 1, 2, 3]
    finally:
        files.release_versions(loading)
    assert prune(tmp_path, 3, keep=2) and files.stable_versions(tmp_path) == [2, 3]


def test_remove_dir_safely_unpublishes_first(tmp_path, monkeypatch):
    wdir = tmp_path / "step_0"
    wdir.mkdir()
    (wdir / "model.pt").write_bytes(b"x")
    files.mark_stable(wdir)
    real_rename = os.rename
    seen = []

    def rename(src, dst):
        seen.append(os.path.exists(os.path.join(src, files.STABLE)))
        return real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    files.remove_dir_safely(wdir)
    assert seen == [False] and not wdir.exists() and os.listdir(tmp_path) == []
