"""The trainer under torchrun (2 gloo ranks on the CPU): same results as one process, supervised."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time

import pytest
import torch

from orchestrator import rundir as files
from orchestrator.embedded.policy import load_policy, sample_group
from orchestrator.embedded.trainer import TrainerConfig, run_trainer, write_trainer_config
from orchestrator.envs.reverse_text import ReverseTextEnv
from orchestrator.trainers import TrainerFailed
from orchestrator.trainers.torchrun import TorchrunTrainer, torchrun_command
from tests.inference.util import REPO, TINY, processes_mentioning

pytestmark = pytest.mark.slow


def tiny_config(**kw) -> TrainerConfig:
    base = dict(policy=TINY, sft_steps=3, sft_batch_size=4, max_steps=4, batch_wait_timeout_s=60.0,
                poll_interval_s=0.01, max_new_tokens=12, lr=1e-2, lr_warmup_steps=0)
    base.update(kw)
    return TrainerConfig(**base)


def samples(model, step: int, count: int, *, zero_mask: bool = False) -> list[dict]:
    env, out = ReverseTextEnv(seed=step), []
    for k in range(count):
        task = env.task(k)
        (c,) = sample_group(model, task.prompt, 1, temperature=1.0, max_new_tokens=12, seed=100 * step + k)
        mask = [0] * len(c.mask) if zero_mask else c.mask
        out.append({"trace_id": k, "group_id": k // 2, "env": env.name, "token_ids": c.token_ids, "mask": mask,
                    "logprobs": c.full_logprobs, "advantage": (k % 3) - 1.0 + 0.25 * k, "policy_start": 0,
                    "lag": 0, "temperature": 1.0})
    return out


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def step_stats(text: str) -> dict[int, dict[str, float]]:
    out = {}
    for line in text.splitlines():
        if line.startswith("trainer step=") and "loss=" in line:
            fields = dict(f.split("=", 1) for f in line.split()[1:])
            out[int(fields["step"])] = {k: float(fields[k].rstrip("s")) for k in ("loss", "clipfrac", "kl", "grad_norm",
                                                                                  "ratio_max", "tokens", "samples")}
    return out


def test_two_ranks_train_like_one_process(tmp_path, capsys):
    single, ddp = tmp_path / "single", tmp_path / "ddp"
    for d in (single, ddp):
        write_trainer_config(d, tiny_config())
    from orchestrator.embedded.trainer import Trainer

    Trainer(single, tiny_config(), log=lambda s: None).init_or_resume()  # publishes step_0
    model = load_policy(files.weights_dir(single, 0))
    # 8 samples (4 per rank), 1 (rank 1 joins with a dummy row), 3 (uneven), none sampled (no-op)
    batches = {1: samples(model, 1, 8), 2: samples(model, 2, 1), 3: samples(model, 3, 3),
               4: samples(model, 4, 2, zero_mask=True)}
    for d in (single, ddp):
        for step, batch in batches.items():
            files.write_batch_file(d, step, batch)
    capsys.readouterr()
    assert run_trainer(single) == 0
    expected = step_stats(capsys.readouterr().out)
    log = open(tmp_path / "ddp.log", "wb")
    proc = subprocess.run(torchrun_command(ddp, 2, "gloo"), stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                          timeout=150)
    out = (tmp_path / "ddp.log").read_text()
    assert proc.returncode == 0, out
    assert "trainer ddp: 2 ranks (gloo, cpu)" in out and "trainer done: 4 steps on 2 ranks" in out
    got = step_stats(out)
    assert sorted(got) == sorted(expected) == [1, 2, 3, 4]
    for step in expected:  # the full-batch loss and gradient, whatever the split
        for key, value in expected[step].items():
            assert got[step][key] == pytest.approx(value, rel=1e-3, abs=1e-6), (step, key, got[step], expected[step])
    # The published policies compute the same function. (Raw weights are not compared: Adam
    # normalizes gradients that are pure rounding noise, e.g. the key biases, which the output
    # does not depend on, so those coordinates differ between any two summation orders.)
    probe = [s["token_ids"] for b in batches.values() for s in b]
    for version in files.stable_versions(single):
        a = load_policy(files.weights_dir(single, version))
        b = load_policy(files.weights_dir(ddp, version))
        for ids in probe:
            x = torch.tensor([ids])
            assert torch.allclose(a(x)[0], b(x)[0], atol=2e-4), version
    ck = torch.load(files.ckpt_dir(ddp) / files.CKPT_FILE, weights_only=True)
    assert ck["step"] == 4 and files.stable_versions(ddp) == files.stable_versions(single)


def _trainer(run_dir, **kw) -> TorchrunTrainer:
    write_trainer_config(run_dir, tiny_config(parent_pid=os.getpid(), **kw))
    trainer = TorchrunTrainer(run_dir, nproc=2, backend="gloo")
    asyncio.run(trainer.start())
    return trainer


def test_a_crashing_rank_is_reported_and_nothing_is_left_running(tmp_path):
    trainer = _trainer(tmp_path)
    try:
        wait_until(lambda: files.is_stable(files.weights_dir(tmp_path, 0)), 90, "the warm start")
        files.write_batch_file(tmp_path, 1, [{"trace_id": 0}])  # a bad batch: every rank fails on it

        def failed() -> bool:
            try:
                trainer.check()
            except TrainerFailed as err:
                failed.message = str(err)
                return True
            return False
        wait_until(failed, 60, "the crash to be noticed")
        assert "orch trainer: error:" in failed.message and "missing field" in failed.message, failed.message
    finally:
        asyncio.run(trainer.stop(0))
    wait_until(lambda: not processes_mentioning(str(tmp_path)), 10, "no process left")


@pytest.mark.parametrize("how", ["stop", "sigkill-agent"])
def test_stopping_or_killing_the_agent_leaves_no_rank_behind(tmp_path, how):
    trainer = _trainer(tmp_path)
    try:
        wait_until(lambda: files.is_stable(files.weights_dir(tmp_path, 0)), 90, "the warm start")
        wait_until(lambda: len(processes_mentioning(str(tmp_path))) >= 3, 30, "agent + 2 ranks")
        if how == "stop":
            asyncio.run(asyncio.wait_for(trainer.stop(0), 15))  # SIGTERM: the agent stops its ranks
        else:
            os.kill(trainer.proc.pid, signal.SIGKILL)
            trainer.proc.wait(5)
        wait_until(lambda: not processes_mentioning(str(tmp_path)), 10, "the ranks to exit")
    finally:
        asyncio.run(trainer.stop(0))
