"""The synchronous simulation: plumbing (fast) and learning (slow)."""

import orjson
import pytest

from orchestrator import rundir as files
from orchestrator.embedded.simulate import SimConfig, grpo_advantages, simulate
from orchestrator.embedded.trainer import DEFAULT_TRAINER_CONFIG

from conftest import tiny_trainer_config


def test_grpo_advantages_are_reward_minus_group_mean():
    assert grpo_advantages([1.0, 0.0, 0.5, 0.5]) == [0.5, -0.5, 0.0, 0.0]


def test_simulate_plumbing_with_lag(tmp_path):
    cfg = SimConfig(trainer=tiny_trainer_config(max_steps=3, keep_weights=2), group_size=4, groups_per_step=3, lag=1)
    res = simulate(tmp_path, cfg, log=lambda s: None)
    assert len(res.rewards) == 3 and all(0.0 <= r <= 1.0 for r in res.rewards)
    assert files.stable_versions(tmp_path)[-1] == 3
    doc = orjson.loads(files.batch_path(tmp_path, 3).read_bytes())
    assert doc["format"] == 1 and doc["step"] == 3
    for s in doc["samples"]:
        assert s["policy_start"] == 1 and s["lag"] == 1  # step 3 sampled with version 3-1-lag
        assert len(s["token_ids"]) == len(s["mask"]) == len(s["logprobs"])
        assert s["advantage"] != 0.0


@pytest.mark.slow
def test_default_config_learns(tmp_path):
    """The recommended defaults: RL on top of the partial warm start clearly raises the reward."""
    cfg = SimConfig(trainer=DEFAULT_TRAINER_CONFIG.model_copy(update={"max_steps": 24}), lag=1)
    lines = []
    res = simulate(tmp_path, cfg, log=lines.append)
    first, last = res.first_last(5)
    print("\n".join(lines))
    print(f"reward curve {[round(r, 3) for r in res.rewards]} first5={first:.3f} last5={last:.3f} "
          f"total={res.total_s:.1f}s")
    assert 0.2 < res.rewards[0] < 0.8  # the warm start is partial: room left for RL
    assert last >= first + 0.1


@pytest.mark.slow
def test_simulate_against_the_trainer_process(tmp_path):
    """End to end through the file protocol only: trainer as an OS process, lag 1, pruning on."""
    cfg = SimConfig(trainer=tiny_trainer_config(max_steps=4, keep_weights=3), group_size=4, groups_per_step=3,
                    lag=1, trainer_process=True, wait_timeout_s=120)
    res = simulate(tmp_path, cfg, log=lambda s: None)
    assert len(res.rewards) == 4
    assert files.stable_versions(tmp_path) == [2, 3, 4]
    assert (files.ckpt_dir(tmp_path) / files.CKPT_FILE).is_file()
