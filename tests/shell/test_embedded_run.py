"""The embedded reverse-text job end to end: trainer process supervision both ways,
Ctrl-C, and a kill/resume. Slow: each run loads torch and transformers twice (the
orchestrator's sampler, the trainer); the tiny model is built once for the module."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
from pathlib import Path

import orjson
import pytest

from tests.support.cli import orch, spawn_orch, wait_until
from tests.support.logs import assert_log_invariants, events, shipped_batches
from tests.support.runs import run_args, sets

pytestmark = pytest.mark.slow

SMALL = sets("batch.size=32", "rollout.group_size=4", "rollout.max_inflight=32", "trainer.publish_timeout_s=120")


@pytest.fixture(autouse=True, scope="module")
def _one_tiny_model_for_every_run(tmp_path_factory):
    """Every run of the module trains the same tiny model dir (not one built per runs dir)."""
    from orchestrator.hf.model import ensure_tiny_model

    SMALL.extend(["--set", f"model.path={ensure_tiny_model(tmp_path_factory.mktemp('cache'), log=lambda s: None)}"])
    yield
    del SMALL[-2:]


def processes_mentioning(text: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmdline and int(entry.name) != os.getpid():
                pids.append(int(entry.name))
    return pids


def spawn_run(tmp_path: Path, *extra: str, **popen) -> subprocess.Popen:
    return spawn_orch(*run_args(tmp_path, *SMALL, *extra), **popen)


def test_short_embedded_run_trains_in_order_and_leaves_no_process(tmp_path):
    result = orch(*run_args(tmp_path, *SMALL, steps=4), timeout=300)
    assert result.returncode == 0, result.stderr
    run_dir = tmp_path / "r"
    assert_log_invariants(run_dir, 4, max_off_policy=2, target_lag=1)
    db = sqlite3.connect(run_dir / "events.db")
    versions = [
        v
        for (v,) in db.execute(
            "SELECT json_extract(data, '$.version') FROM events WHERE kind = 'version_published' ORDER BY seq"
        )
    ]
    assert versions == [1, 2, 3, 4]
    trained = [
        line.split()[1]
        for line in (run_dir / "trainer.log").read_text().splitlines()
        if line.startswith("trainer step=")
    ]
    assert trained == ["step=1", "step=2", "step=3", "step=4"]
    assert processes_mentioning(str(run_dir)) == []


def test_with_update_mode_interrupt_a_version_takes_over_mid_batch_and_every_token_is_its_versions(tmp_path):
    """Long answers (40-46 characters) and 64 episodes in flight: the sampler is busy when the
    trainer publishes, and the new version takes over inside its batches."""
    from tests.inference.vllm_util import check_completion_versions
    from tests.support.logs import events

    interrupt = sets(
        "inference.embedded.update_mode=interrupt",
        "rollout.max_inflight=64",
        "env.reverse_text.min_len=40",
        "env.reverse_text.max_len=46",
        "rollout.max_new_tokens=64",
        "trainer.hf.keep_weights=7",  # every version stays on disk: each completion checked against its own
    )
    result = orch(*run_args(tmp_path, *SMALL, *interrupt, steps=6), timeout=300)
    assert result.returncode == 0, result.stderr
    run_dir = tmp_path / "r"
    assert_log_invariants(run_dir, 6, max_off_policy=2, target_lag=1)
    seamed = [e for _, e in events(run_dir, "episode_completed") if e.get("token_versions")]
    assert seamed
    assert check_completion_versions(run_dir, lora=False) > 0  # each token's logprob is its version's
    assert processes_mentioning(str(run_dir)) == []


def test_trainer_error_stops_the_orchestrator_with_the_trainers_message(tmp_path):
    run_dir = tmp_path / "r"
    proc = spawn_run(tmp_path, "--max-steps", "10")
    try:
        wait_until(lambda: (run_dir / "trainer.json").exists(), 60, "the run directory")
        (run_dir / "batches").mkdir(exist_ok=True)
        (run_dir / "batches" / "step_1.safetensors").write_text("{not a batch")  # before the real batch 1
        proc.wait(timeout=120)
    finally:
        proc.kill()
    stderr = proc.stderr.read()
    assert proc.returncode == 1
    last = stderr.strip().splitlines()[-1]
    assert (
        last.startswith("orch: error: trainer exited with code 1; its last error line: orch trainer: error:")
        and "step_1.safetensors" in last
    )
    wait_until(lambda: processes_mentioning(str(run_dir)) == [], 10, "no process left")


def test_orchestrator_crash_makes_the_trainer_exit(tmp_path):
    run_dir = tmp_path / "r"
    proc = spawn_run(tmp_path, "--max-steps", "50")
    wait_until(lambda: shipped_batches(run_dir) >= 1, 120, "batch 1")
    trainers = [pid for pid in processes_mentioning(str(run_dir)) if pid != proc.pid]
    assert trainers, "the trainer child should be running"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    wait_until(lambda: processes_mentioning(str(run_dir)) == [], 10, "the orphaned trainer to exit")


def test_ctrl_c_drains_and_stops_within_a_bound_then_resume_finishes(tmp_path):
    run_dir = tmp_path / "r"
    proc = spawn_run(tmp_path, "--max-steps", "6")
    wait_until(lambda: shipped_batches(run_dir) >= 2, 120, "batch 2")
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=30)  # drains and stops within a bound
    assert proc.returncode == 130
    wait_until(lambda: processes_mentioning(str(run_dir)) == [], 10, "no process left")
    resumed = orch("run", "--resume", str(run_dir), timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert_log_invariants(run_dir, 6, max_off_policy=2, target_lag=1)


def test_terminal_ctrl_c_during_start_up_stops_cleanly_then_resume_finishes(tmp_path):
    """Ctrl-C in a terminal signals the whole process group, while torch loads and the trainer
    warms up: the run stops on interrupt (130, not 'aborted', not 'trainer failed'), leaves no
    process, and --resume finishes it (from an empty log if nothing had been committed)."""
    run_dir = tmp_path / "r"
    proc = spawn_run(tmp_path, "--max-steps", "2", start_new_session=True)
    # trainer.json is written once the run's loop (and its signal handlers) runs; the trainer,
    # started before the model's checks, then loads the model and publishes its warm start
    wait_until(lambda: (run_dir / "trainer.json").exists(), 120, "the trainer's config")
    os.killpg(proc.pid, signal.SIGINT)
    proc.wait(timeout=120)
    stderr = proc.stderr.read()
    assert proc.returncode == 130, stderr
    assert "stopped on interrupt" in stderr and "aborted" not in stderr and "Traceback" not in stderr
    wait_until(lambda: processes_mentioning(str(run_dir)) == [], 10, "no process left")
    resumed = orch("run", "--resume", str(run_dir), timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert_log_invariants(run_dir, 2, max_off_policy=2, target_lag=1)


def test_sigkill_then_resume_of_the_embedded_job(tmp_path):
    run_dir = tmp_path / "r"
    proc = spawn_run(tmp_path, "--max-steps", "6")
    wait_until(lambda: shipped_batches(run_dir) >= 3, 150, "batch 3")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    wait_until(lambda: processes_mentioning(str(run_dir)) == [], 10, "the trainer to exit")
    resumed = orch("run", "--resume", str(run_dir), timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert_log_invariants(run_dir, 6, max_off_policy=2, target_lag=1)
    assert processes_mentioning(str(run_dir)) == []


def test_embedded_run_with_its_env_behind_an_env_server(tmp_path):
    """`rollout.env_server`: tasks and rewards come from `orch env-server` over HTTP."""
    from orchestrator.config import served_env
    from orchestrator.envs.server import create_app, running_server

    app = create_app(served_env("reverse_text", seed=0))
    with running_server(app) as server:
        result = orch(
            *run_args(tmp_path, *SMALL, "--set", f"env.reverse_text.server={server.base_url}", steps=2), timeout=300
        )
    assert result.returncode == 0, result.stderr
    assert_log_invariants(tmp_path / "r", 2, max_off_policy=2, target_lag=1)
    db = sqlite3.connect(tmp_path / "r" / "events.db")
    completed = db.execute("SELECT count(*) FROM events WHERE kind = 'episode_completed'").fetchone()[0]
    assert app.state.stats["task"] >= completed >= 64 and app.state.stats["score_completed"] >= completed


def test_an_env_server_of_a_pool_killed_mid_run_fails_no_episode(tmp_path):
    """`env.reverse_text.server` as a pool: one member (an `orch env-server` process) SIGKILLed
    once a batch shipped; its calls in flight and every later call go to the other member."""
    import sys

    from orchestrator.config import served_env
    from orchestrator.envs.server import create_app, running_server

    run_dir = tmp_path / "r"
    app = create_app(served_env("reverse_text", seed=0))
    doomed = subprocess.Popen(
        [sys.executable, "-m", "orchestrator.envs.cli", "--port", "0", "--seed", "0", "--log-level", "warning"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    try:
        assert doomed.stdout is not None
        doomed_url = None
        while doomed_url is None and (line := doomed.stdout.readline()):  # it prints its address, or exits
            if "listening on " in line:
                doomed_url = line.rsplit("listening on ", 1)[1].strip()
        assert doomed_url, "the env server did not report its address"
        with running_server(app) as kept:
            pool = f'env.reverse_text.server=["{doomed_url}", "{kept.base_url}"]'
            proc = spawn_run(tmp_path, "--max-steps", "6", "--set", pool)
            wait_until(lambda: shipped_batches(run_dir) >= 2 or proc.poll() is not None, 150, "batch 2")
            served_before = app.state.stats["score_completed"]
            doomed.kill()
            _, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr
    finally:
        doomed.kill()
        doomed.wait(10)
        doomed.stdout.close()
    assert_log_invariants(run_dir, 6, max_off_policy=2, target_lag=1)
    completed = [fields for _, fields in events(run_dir, "episode_completed")]
    assert completed and all(e["ok"] for e in completed), "an episode failed with the pool's member"
    assert app.state.stats["score_completed"] > served_before  # the kept member took over


def test_a_killed_trainer_is_restarted_from_its_checkpoint_and_the_run_completes(tmp_path):
    run_dir = tmp_path / "r"
    proc = spawn_run(tmp_path, "--max-steps", "6")
    try:
        wait_until(lambda: shipped_batches(run_dir) >= 2, 150, "batch 2")
        trainers = [pid for pid in processes_mentioning(str(run_dir)) if pid != proc.pid]
        assert len(trainers) == 1, trainers
        os.kill(trainers[0], signal.SIGKILL)
        _, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr
    assert "trainer was killed by signal SIGKILL; it logged no error; restarting it from its checkpoint" in stderr
    db = sqlite3.connect(run_dir / "events.db")
    restarts = db.execute(
        "SELECT json_extract(data, '$.attempt'), json_extract(data, '$.cause') FROM events"
        " WHERE kind = 'trainer_restarted'"
    ).fetchall()
    assert restarts == [(1, "trainer was killed by signal SIGKILL; it logged no error")]
    assert_log_invariants(run_dir, 6, max_off_policy=2, target_lag=1)  # each step trained once, in order
    versions = [
        v for (v,) in db.execute("SELECT json_extract(data, '$.version') FROM events WHERE kind = 'version_published'")
    ]
    assert versions == [1, 2, 3, 4, 5, 6]  # the restarted trainer went on from its checkpoint
    assert processes_mentioning(str(run_dir)) == []
    assert orch("replay", str(run_dir), "--check").returncode == 0
    shown = orch("replay", str(run_dir), "--json")
    assert shown.returncode == 0, shown.stderr
    assert [(f["kind"], f["attempt"]) for f in orjson.loads(shown.stdout)["faults"]] == [("trainer_restarted", 1)]
    table = orch("replay", str(run_dir), env={**os.environ, "COLUMNS": "200"})
    assert "faults" in table.stdout and "trainer restarted (1)" in table.stdout


def test_an_untrained_model_stops_for_zero_output_naming_the_equal_rewards(tmp_path):
    """A fresh (not warm-started) model never writes the answer's tags: reward 0 for every
    episode, so every group ties and is rejected; the stop line says so and what changes it."""
    from orchestrator.hf.tiny_model import build_untrained

    model, tokenizer = build_untrained()
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    result = orch(*run_args(tmp_path, *sets(f"model.path={tmp_path / 'model'}", "zero_output_batches=1"), steps=3))
    assert result.returncode == 1, result.stderr
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("orch: error: ")]
    assert line.startswith(
        "orch: error: run stopped: zero_output: every group's rewards were equal, so every advantage was zero "
        "and no group was admitted for training (reward 0.000 in every one of the last "
    ), line
    assert "a warm-started model.path), a larger rollout.group_size or a higher rollout.temperature" in line
