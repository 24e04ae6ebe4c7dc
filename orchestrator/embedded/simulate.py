"""A small, honest, synchronous stand-in for the orchestrator, to tune the embedded trainer.

Per step N: sample ``groups_per_step`` groups of ``group_size`` completions with
:class:`EmbeddedSampler` holding version ``max(0, N-1-lag)`` (lag > 0 mimics the async
orchestrator's off-policy samples), score them with :class:`ReverseTextEnv`, GRPO advantages
(reward - group mean; groups with all-equal rewards and zero-advantage samples are dropped, as the
orchestrator's default admission and pruning do), write ``batches/step_N.json`` through the real
file contract, then run the real trainer step in-process (parse, one optimizer step, checkpoint,
publish ``weights/step_N`` + STABLE). With ``--process`` the trainer is a separate OS process
instead and the loop only talks to it through the files (waits for ``weights/step_v/STABLE``).

    python -m orchestrator.embedded.simulate --run-dir /tmp/sim --lag 1            # in-process trainer
    python -m orchestrator.embedded.simulate --run-dir /tmp/sim2 --lag 1 --process  # trainer process
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import click
import torch
from pydantic import BaseModel, ConfigDict, Field

from orchestrator import rundir as files
from orchestrator.embedded import defaults
from orchestrator.embedded.policy import EmbeddedSampler
from orchestrator.embedded.trainer import DEFAULT_TRAINER_CONFIG, Trainer, TrainerConfig, write_trainer_config
from orchestrator.envs.reverse_text import ReverseTextEnv

DEFAULT_GROUP_SIZE = defaults.GROUP_SIZE
DEFAULT_GROUPS_PER_STEP = defaults.GROUPS_PER_STEP


class SimConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    trainer: TrainerConfig = Field(default_factory=lambda: DEFAULT_TRAINER_CONFIG.model_copy())
    group_size: int = Field(DEFAULT_GROUP_SIZE, ge=2)
    groups_per_step: int = Field(DEFAULT_GROUPS_PER_STEP, ge=1)
    env_seed: int = 0
    lag: int = Field(0, ge=0, description="sample step N with version max(0, N-1-lag)")
    trainer_process: bool = Field(
        False,
        description="run the trainer as a separate OS process (python -m orchestrator.embedded.trainer) "
        "and talk to it only through the files, as the orchestrator does",
    )
    wait_timeout_s: float = Field(300.0, gt=0, description="process mode: bound on each weight wait")


@dataclass
class SimResult:
    sft_reward: float = 0.0
    rewards: list[float] = field(default_factory=list)  # mean reward of all samples, per step
    samples: list[int] = field(default_factory=list)  # samples shipped per step (after pruning)
    sample_s: float = 0.0
    train_s: float = 0.0
    sft_s: float = 0.0
    total_s: float = 0.0

    def first_last(self, k: int = 5) -> tuple[float, float]:
        first, last = self.rewards[:k], self.rewards[-k:]
        return sum(first) / len(first), sum(last) / len(last)


def grpo_advantages(rewards: list[float]) -> list[float]:
    mean = sum(rewards) / len(rewards)
    return [r - mean for r in rewards]


def _wait_stable(run_dir: Path, version: int, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    wdir = files.weights_dir(run_dir, version)
    while not files.is_stable(wdir):
        if proc.poll() is not None:
            raise RuntimeError(f"simulate: trainer process exited with code {proc.returncode} "
                               f"before publishing version {version}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"simulate: no {wdir}/{files.STABLE} after {timeout_s:.0f}s")
        time.sleep(0.01)


def simulate(run_dir: str | os.PathLike, config: SimConfig, log=print) -> SimResult:
    t_start = time.perf_counter()
    run_dir = Path(run_dir)
    tcfg = config.trainer
    if tcfg.keep_weights < config.lag + 2:
        tcfg = tcfg.model_copy(update={"keep_weights": config.lag + 2})
    res = SimResult()
    proc: subprocess.Popen | None = None
    trainer: Trainer | None = None
    t0 = time.perf_counter()
    if config.trainer_process:
        write_trainer_config(run_dir, tcfg.model_copy(update={"parent_pid": os.getpid()}))
        proc = subprocess.Popen([sys.executable, "-m", "orchestrator.embedded.trainer", "--run-dir", str(run_dir)])
        start_step = 0
    else:
        write_trainer_config(run_dir, tcfg)
        trainer = Trainer(run_dir, tcfg, log=log)
        start_step = trainer.init_or_resume()
    try:
        if proc is not None:
            _wait_stable(run_dir, 0, proc, config.wait_timeout_s)
        res.sft_s = time.perf_counter() - t0
        sampler = EmbeddedSampler.from_weights(files.weights_dir(run_dir, start_step), start_step)
        env = ReverseTextEnv(seed=config.env_seed, min_len=tcfg.env_min_len, max_len=tcfg.env_max_len)
        cursor = start_step * config.groups_per_step
        for step in range(start_step + 1, tcfg.max_steps + 1):
            version = max(0, step - 1 - config.lag)
            if proc is not None:
                _wait_stable(run_dir, version, proc, config.wait_timeout_s)
            if sampler.version != version:
                sampler.reload(files.weights_dir(run_dir, version), version)
            t0 = time.perf_counter()
            samples, all_rewards = [], []
            tasks = [env.task(cursor + g) for g in range(config.groups_per_step)]
            groups = sampler.sample_groups(
                [t.prompt for t in tasks],
                config.group_size,
                temperature=tcfg.temperature,
                max_new_tokens=tcfg.max_new_tokens,
                seeds=[tcfg.seed * 1_000_003 + step * 1_000 + g for g in range(config.groups_per_step)],
            )
            for g, (task, comps) in enumerate(zip(tasks, groups)):
                group_id = cursor + g
                rewards = [env.score(task, c.text) for c in comps]
                all_rewards += rewards
                for k, (c, r, a) in enumerate(zip(comps, rewards, grpo_advantages(rewards))):
                    if a == 0.0 or not c.completion_ids:
                        continue
                    samples.append(
                        {
                            "trace_id": group_id * config.group_size + k,
                            "group_id": group_id,
                            "env": env.name,
                            "token_ids": c.token_ids,
                            "mask": c.mask,
                            "logprobs": c.full_logprobs,
                            "advantage": a,
                            "policy_start": c.policy_version,
                            "lag": (step - 1) - c.policy_version,
                            "temperature": tcfg.temperature,
                            "reward": r,
                        }
                    )
            cursor += config.groups_per_step
            files.write_batch_file(run_dir, step, samples)
            res.sample_s += time.perf_counter() - t0
            res.rewards.append(sum(all_rewards) / len(all_rewards))
            res.samples.append(len(samples))
            line = f"sim step={step} reward={res.rewards[-1]:.3f} shipped={len(samples)} version={version}"
            if trainer is not None:
                stats = trainer.train_step(step, wait=False)
                res.train_s += stats.train_s
                line += f" | {stats.line()}"
            log(line)
        if proc is not None:
            rc = proc.wait(timeout=config.wait_timeout_s)
            if rc != 0:
                raise RuntimeError(f"simulate: trainer process exited with code {rc}")
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
    res.total_s = time.perf_counter() - t_start
    return res


@click.command()
@click.option("--run-dir", required=True, type=click.Path(file_okay=False, path_type=Path))
@click.option("--steps", type=int, default=None, help="override max_steps")
@click.option("--lag", type=int, default=0)
@click.option("--set", "overrides", multiple=True, help="trainer field=value (JSON value), repeatable")
@click.option("--groups", type=int, default=DEFAULT_GROUPS_PER_STEP)
@click.option("--threads", type=int, default=1)
@click.option("--process", is_flag=True, help="run the trainer as a separate process (file protocol only)")
def main(run_dir: Path, steps: int | None, lag: int, overrides: tuple[str, ...], groups: int, threads: int,
         process: bool) -> None:
    """Run the synchronous simulation and print the reward curve."""
    import json

    torch.set_num_threads(threads)
    upd = {}
    for o in overrides:
        k, v = o.split("=", 1)
        upd[k] = json.loads(v)
    if steps is not None:
        upd["max_steps"] = steps
    tcfg = TrainerConfig.model_validate({**DEFAULT_TRAINER_CONFIG.model_dump(), **upd})
    res = simulate(run_dir, SimConfig(trainer=tcfg, lag=lag, groups_per_step=groups, trainer_process=process))
    f, l = res.first_last()
    print("curve", " ".join(f"{r:.3f}" for r in res.rewards))
    print(
        f"first5={f:.3f} last5={l:.3f} delta={l - f:+.3f} sft={res.sft_s:.1f}s sample={res.sample_s:.1f}s "
        f"train={res.train_s:.1f}s total={res.total_s:.1f}s"
    )


if __name__ == "__main__":
    main()
