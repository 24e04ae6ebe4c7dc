"""The trainer: in-process loop, resume, errors, and the OS process (bad batch, parent death)."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import orjson
import pytest
import torch

from orchestrator import rundir as files
from orchestrator.embedded.policy import load_policy
from orchestrator.embedded.trainer import Trainer, run_trainer, write_trainer_config

from conftest import make_samples, tiny_trainer_config

REPO = Path(__file__).resolve().parents[2]


def _write_batches(run_dir, steps):
    model = load_policy(files.weights_dir(run_dir, 0))
    for s in steps:
        files.write_batch_file(run_dir, s, make_samples(model, s))


def _state(run_dir, version):
    return load_policy(files.weights_dir(run_dir, version)).state_dict()


def test_run_trainer_warm_starts_trains_and_publishes(tmp_path, capsys):
    write_trainer_config(tmp_path, tiny_trainer_config(max_steps=3, keep_weights=2))
    trainer = Trainer(tmp_path, tiny_trainer_config(max_steps=3), log=lambda s: None)
    trainer.init_or_resume()  # publishes step_0 so the batches can be sampled from it
    _write_batches(tmp_path, [1, 2, 3])
    capsys.readouterr()
    assert run_trainer(tmp_path) == 0
    out = capsys.readouterr().out
    step_lines = [line for line in out.splitlines() if line.startswith("trainer step=")]
    assert [line.split()[1] for line in step_lines] == ["step=1", "step=2", "step=3"]
    for key in ("loss=", "adv_mean=", "tokens=", "train="):
        assert key in step_lines[0]
    assert files.stable_versions(tmp_path) == [2, 3]  # keep_weights=2 pruned 0 and 1
    assert not any(torch.equal(a, b) for a, b in zip(_state(tmp_path, 2).values(), _state(tmp_path, 3).values())
                   if a.dtype.is_floating_point and a.numel() > 1)


def test_resume_skips_done_steps_and_matches_an_uninterrupted_run(tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        write_trainer_config(d, tiny_trainer_config(max_steps=3))
        Trainer(d, tiny_trainer_config(max_steps=3), log=lambda s: None).init_or_resume()
        _write_batches(d, [1, 2, 3])
    assert run_trainer(a) == 0  # uninterrupted
    # b: train 2 steps, "crash", lose the publication of step 2, resume
    write_trainer_config(b, tiny_trainer_config(max_steps=2))
    assert run_trainer(b) == 0
    files.remove_dir_safely(files.weights_dir(b, 2))
    write_trainer_config(b, tiny_trainer_config(max_steps=3))
    capsys.readouterr()
    assert run_trainer(b) == 0
    out = capsys.readouterr().out
    assert "resumed from" in out and "at step 2" in out and "warm start" not in out
    assert [line.split()[1] for line in out.splitlines() if line.startswith("trainer step=")] == ["step=3"]
    assert files.is_stable(files.weights_dir(b, 2))  # the lost publication was redone
    for k, v in _state(a, 3).items():
        assert torch.equal(v, _state(b, 3)[k]), k  # optimizer state restored exactly
    capsys.readouterr()
    assert run_trainer(b) == 0  # already done: nothing to train
    assert "trainer step=" not in capsys.readouterr().out


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d["samples"][0].update(mask=[0, 1]), "lengths differ"),
        (lambda d: d.update(step=7), "step must be 1"),
        (lambda d: d["samples"][1].pop("advantage"), "missing field(s) ['advantage']"),
        (lambda d: d["samples"][0]["token_ids"].__setitem__(1, 999), "token id outside"),
        (lambda d: d.update(format=2), "format must be 1"),
    ],
)
def test_bad_batch_is_a_clear_error(tmp_path, capsys, mutate, message):
    write_trainer_config(tmp_path, tiny_trainer_config(max_steps=1))
    Trainer(tmp_path, tiny_trainer_config(), log=lambda s: None).init_or_resume()
    model = load_policy(files.weights_dir(tmp_path, 0))
    doc = {"format": 1, "step": 1, "samples": make_samples(model, 1)}
    mutate(doc)
    files.atomic_write_bytes(files.batch_path(tmp_path, 1), orjson.dumps(doc))
    capsys.readouterr()
    assert run_trainer(tmp_path) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("orch trainer: error: ") and message in err[0] and "step_1.json" in err[0]
    assert any("Traceback" in line for line in err)
    assert files.stable_versions(tmp_path) == [0]  # nothing published for the bad step


def test_missing_config_and_wait_timeout_are_clear_errors(tmp_path, capsys):
    assert run_trainer(tmp_path) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "no trainer config" in err[0]  # a setup mistake: one line, no traceback
    write_trainer_config(tmp_path, tiny_trainer_config(batch_wait_timeout_s=0.2))
    assert run_trainer(tmp_path) == 1
    captured = capsys.readouterr()
    assert "waiting for" in captured.out and "step_1.json" in captured.out
    assert "timed out after 0s" in captured.err.splitlines()[0]  # the configured bound, not the default


def _env():
    return {**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"}


@pytest.mark.slow
def test_trainer_process_bad_batch_exits_nonzero(tmp_path):
    write_trainer_config(tmp_path, tiny_trainer_config(max_steps=1))
    files.batches_dir(tmp_path).mkdir()
    files.batch_path(tmp_path, 1).write_bytes(b"{not json")
    proc = subprocess.run([sys.executable, "-m", "orchestrator.embedded.trainer", "--run-dir", str(tmp_path)],
                          cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    first = proc.stderr.splitlines()[0]
    assert first.startswith("orch trainer: error: ") and "not valid JSON" in first
    assert "trainer warm start" in proc.stdout


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow
def test_trainer_process_exits_when_its_parent_dies(tmp_path):
    log = tmp_path / "trainer.log"
    parent = textwrap.dedent(f"""
        import os, subprocess, sys, time
        sys.path.insert(0, {str(REPO)!r}); sys.path.insert(0, {str(Path(__file__).parent)!r})
        from conftest import tiny_trainer_config
        from orchestrator.embedded.trainer import write_trainer_config
        write_trainer_config({str(tmp_path)!r}, tiny_trainer_config(parent_pid=os.getpid(), batch_wait_timeout_s=300))
        with open({str(log)!r}, "w") as f:
            p = subprocess.Popen([sys.executable, "-m", "orchestrator.embedded.trainer", "--run-dir", {str(tmp_path)!r}],
                                 stdout=f, stderr=subprocess.STDOUT)
        print(p.pid, flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", parent], cwd=REPO, env=_env(), stdout=subprocess.PIPE, text=True)
    trainer_pid = None
    try:
        trainer_pid = int(proc.stdout.readline())
        deadline = time.monotonic() + 120
        while "waiting for" not in (log.read_text() if log.exists() else ""):
            assert time.monotonic() < deadline, log.read_text()
            assert _alive(trainer_pid), log.read_text()
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 10
        while _alive(trainer_pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not _alive(trainer_pid), "trainer outlived its parent by 10 s"
        assert "parent process" in log.read_text() and "is gone" in log.read_text()  # its watchdog saw it
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if trainer_pid is not None and _alive(trainer_pid):  # never leave an orphan behind
            os.kill(trainer_pid, signal.SIGKILL)
