"""`orch run` end to end with LoRA: the hf trainer publishes every version as a PEFT adapter
(step_0 a zero one), a vLLM-CPU server that orch starts loads each as adapter step_N and unloads
those no request uses any more."""

from __future__ import annotations

import re
import subprocess

import pytest

from tests.inference.util import REPO
from tests.inference.vllm_util import LORA_RANK, check_completion_versions, needs_vllm, reverse_text_hf_run
from tests.support.logs import assert_log_invariants

pytestmark = [pytest.mark.slow, needs_vllm]
STEPS = 6
MAX_LORAS = 2


def test_a_lora_run_samples_each_version_from_its_adapter_and_keeps_at_most_max_loras(tmp_path):
    done = subprocess.run(
        reverse_text_hf_run(
            tmp_path,
            STEPS,
            "inference.openai.weight_sync=vllm_lora",
            f"inference.openai.max_loras={MAX_LORAS}",
            f"trainer.hf.lora.rank={LORA_RANK}",
            f"inference.openai.launch.max_lora_rank={LORA_RANK}",
            "batch.size=64",
            "trainer.hf.keep_weights=8",
        ),
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=1200,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = tmp_path / "r"
    assert_log_invariants(run_dir, STEPS, max_off_policy=2, target_lag=1)
    assert check_completion_versions(run_dir, lora=True) >= 8
    # What the server held, from its own log: never more than max_loras adapters at once.
    held, most, loaded = set(), 0, []
    for line in (run_dir / "logs" / "vllm-0.log").read_text().splitlines():
        if m := re.search(r"Loaded new LoRA adapter: name '(step_\d+)'", line):
            held.add(m[1])
            loaded.append(m[1])
        elif m := re.search(r"Removed LoRA adapter: name '(step_\d+)'", line):
            held.discard(m[1])
        most = max(most, len(held))
    assert loaded[0] == "step_0" and len(set(loaded)) >= STEPS - 1, loaded
    assert most <= MAX_LORAS
