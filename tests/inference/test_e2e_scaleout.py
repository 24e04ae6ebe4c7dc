"""End to end on loopback: `orch run` against 2 `orch serve` processes, the trainer under torchrun
with 2 CPU ranks; one server is SIGKILLed mid-run and the run still completes consistently."""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import sys
import time

import pytest

from tests.inference.util import REPO, ServeProcess, processes_mentioning
from tests.shell.test_e2e_fake import assert_log_invariants

pytestmark = pytest.mark.slow

STEPS = 6


def count(db_path, kind: str) -> int:
    try:
        db = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True, timeout=1)
        try:
            return db.execute("SELECT count(*) FROM events WHERE kind = ?", (kind,)).fetchone()[0]
        finally:
            db.close()
    except sqlite3.Error:
        return 0


def test_run_on_two_servers_and_a_torchrun_trainer_survives_losing_a_server(tmp_path):
    servers = [ServeProcess(), ServeProcess()]
    run_dir = tmp_path / "r"
    try:
        urls = [s.wait_ready() for s in servers]
        cmd = [sys.executable, "-m", "orchestrator.cli", "run", "--runs-dir", str(tmp_path), "--name", "r",
               "--max-steps", str(STEPS), "--inference", ",".join(urls), "--progress-every", "1",
               "--set", "trainer.embedded.nproc=2", "--set", "rollout.group_size=4", "--set", "batch.size=16",
               "--set", "rollout.max_inflight=32", "--set", "log.durability=normal",
               "--set", "inference.openai.backoff_s=0.5", "--set", "trainer.publish_timeout_s=120"]
        t0 = time.monotonic()
        run = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
        try:
            db = run_dir / "events.db"
            while count(db, "batch_shipped") < 2:
                assert run.poll() is None, run.communicate()
                assert time.monotonic() - t0 < 120, "the run did not reach step 2"
                time.sleep(0.05)
            # Mid-run. Freeze server 0 so that the requests it holds (and those routed to it
            # meanwhile) are surely in flight when it dies, then kill it.
            servers[0].proc.send_signal(signal.SIGSTOP)
            dispatched, deadline = count(db, "episode_dispatched"), time.monotonic() + 5
            while count(db, "episode_dispatched") < dispatched + 16 and time.monotonic() < deadline:
                time.sleep(0.05)
            servers[0].kill()
            out, err = run.communicate(timeout=120)
        finally:
            if run.poll() is None:
                run.kill()
                run.wait()
    finally:
        for s in servers:
            s.stop()
    assert run.returncode == 0, err
    assert f"step    {STEPS}/{STEPS}" in out
    # The dead server was noticed on the requests it held (the connection broke mid-request, not a
    # refused connect: ReadError/RemoteProtocolError) and they were sent again to the other one.
    assert f"inference endpoint {urls[0]} marked down" in err, err
    (report,) = [line for line in err.splitlines() if line.startswith("orch: inference: ")]
    dead, alive = report[len("orch: inference: "):].split("; ")[:2]
    assert dead.startswith(urls[0]) and dead.endswith(", down") and alive.startswith(urls[1]), report
    assert "RemoteProtocolError /v1/completions" in dead or "ReadError /v1/completions" in dead, report
    resent = int(report.split("; ")[-1].split()[0])
    assert resent >= 1, report
    # Consistent result: each step shipped once, ship hold, batch files = logged sha256, conservation.
    assert_log_invariants(run_dir, STEPS, max_off_policy=2, target_lag=1)
    db = sqlite3.connect(f"file:{run_dir / 'events.db'}?mode=ro", uri=True)
    failed = db.execute("SELECT count(*) FROM events WHERE kind = 'episode_completed'"
                        " AND json_extract(data, '$.ok') = 0").fetchone()[0]
    assert failed == 0  # no episode was lost to the kill: each was re-sent and completed
    versions = db.execute("SELECT max(json_extract(data, '$.policy_end')) FROM events"
                          " WHERE kind = 'episode_completed'").fetchone()[0]
    assert versions >= 1  # episodes were sampled by weights the servers loaded during the run
    trainer_log = (run_dir / "trainer.log").read_text()
    assert "trainer ddp: 2 ranks (gloo, cpu)" in trainer_log and trainer_log.count("ranks=2") == STEPS
    assert not processes_mentioning(str(run_dir))  # the trainer's agent and ranks are gone
