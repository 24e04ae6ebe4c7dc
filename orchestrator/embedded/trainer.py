"""The embedded trainer: a separate OS process that turns batch files into weight versions.

Run it as ``orch trainer --run-dir RUN_DIR`` (:data:`trainer_command`) or call
:func:`run_trainer` (returns the exit code). Its configuration is ``RUN_DIR/trainer.json``
(:class:`TrainerConfig`; write it with :func:`write_trainer_config`).

Lifecycle (file contracts in :mod:`orchestrator.rundir`):

1. No checkpoint in ``RUN_DIR/trainer_ckpt/``: build the policy (seeded), run a short supervised
   warm start on reverse_text tasks (``sft_steps``), checkpoint step 0, publish ``weights/step_0``.
   With a checkpoint: load it (model, optimizer, step) and re-publish its version if that
   publication had not completed.
2. For N = last_step+1 .. max_steps: wait (at most ``batch_wait_timeout_s``) for
   ``batches/step_N.json``, take ONE optimizer step of the clipped importance-ratio
   policy-gradient loss (:func:`pg_loss`), checkpoint step N, publish ``weights/step_N`` then its
   STABLE marker, delete versions older than the newest ``keep_weights``.
3. Exit 0 after max_steps. Any error: one line ``orch trainer: error: ...`` on stderr, then the
   traceback, exit 1. If ``parent_pid`` is set and that process dies, exit (code 3) within ~0.25 s.

stdout: one line per event worth knowing (warm start, each step, the first wait, any wait > 2 s),
flushed.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import click
import orjson
import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from orchestrator import rundir as files
from orchestrator.embedded import defaults
from orchestrator.embedded.policy import (
    Policy,
    PolicyConfig,
    build_policy,
    pad_batch,
    sample_groups,
    save_weights,
    token_logprobs,
)
from orchestrator.embedded.tokenizer import VOCAB_SIZE, encode_completion, encode_prompt
from orchestrator.envs.reverse_text import ReverseTextEnv

EXIT_OK, EXIT_ERROR, EXIT_PARENT_DIED = 0, 1, 3


class TrainerConfig(BaseModel):
    """``RUN_DIR/trainer.json``. Defaults are the measured recommendation for ``make run``."""

    model_config = ConfigDict(extra="forbid")

    max_steps: int = Field(defaults.MAX_STEPS, ge=0, description="train on batches 1..max_steps, then exit 0")
    lr: float = Field(defaults.LR, gt=0, description="Adam learning rate of the RL steps")
    lr_warmup_steps: int = Field(defaults.LR_WARMUP_STEPS, ge=0, description="RL lr ramps linearly over the first steps")
    clip_eps: float = Field(defaults.CLIP_EPS, gt=0, description="PPO clip: ratio clipped to [1-eps, 1+eps]")
    grad_clip: float = Field(1.0, gt=0, description="max grad norm per optimizer step")
    seed: int = Field(0, description="policy init + warm-start task order")
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    sft_steps: int = Field(400, ge=0, description="warm-start steps at most (0 = random init)")
    sft_stop_loss: float | None = Field(
        defaults.SFT_STOP_LOSS,
        gt=0,
        description="stop the warm start once the smoothed teacher-forced loss (nats/token) is "
        "<= this: a partial solution that leaves room for RL (None = run all sft_steps)",
    )
    sft_lr: float = Field(3e-3, gt=0)
    sft_batch_size: int = Field(32, ge=1)
    sft_env_seed: int = Field(
        1_000_003, description="reverse_text seed of the warm-start tasks (not the run's tasks)"
    )
    env_min_len: int = Field(3, ge=1, description="warm-start task lengths (match the run's env)")
    env_max_len: int = Field(6, ge=1)
    temperature: float = Field(
        defaults.TEMPERATURE, gt=0, description="recommended sampling temperature (the loss uses each sample's own)"
    )
    max_new_tokens: int = Field(defaults.MAX_NEW_TOKENS, ge=1, description="recommended sampler cap (answers need <= 38)")
    batch_wait_timeout_s: float = Field(300.0, gt=0, description="bound on the wait for one batch")
    poll_interval_s: float = Field(0.02, gt=0, description="batch file polling period")
    parent_pid: int | None = Field(None, description="exit when this process dies")
    keep_weights: int = Field(defaults.KEEP_WEIGHTS, ge=2, description="weight versions kept on disk (newest ones)")
    num_threads: int = Field(1, ge=1, description="torch intra-op threads")


DEFAULT_TRAINER_CONFIG = TrainerConfig()


class TrainerError(RuntimeError):
    """A clear, user-facing trainer failure (bad batch, timeout, config mismatch)."""


class TrainerSetupError(TrainerError):
    """The run dir has no usable trainer.json: a user mistake (`orch trainer` pointed at the
    wrong directory), reported in one line without a traceback."""


def write_trainer_config(run_dir: str | os.PathLike, config: TrainerConfig) -> Path:
    path = Path(run_dir) / files.TRAINER_CONFIG_FILE
    files.atomic_write_bytes(path, config.model_dump_json(indent=2).encode())
    return path


def read_trainer_config(run_dir: str | os.PathLike) -> TrainerConfig:
    path = Path(run_dir) / files.TRAINER_CONFIG_FILE
    if not path.is_file():
        raise TrainerSetupError(f"no trainer config at {path} (the orchestrator writes it before spawning)")
    try:
        return TrainerConfig.model_validate_json(path.read_bytes())
    except ValidationError as exc:
        raise TrainerSetupError(f"invalid {path}: {exc.errors()[0]['loc']}: {exc.errors()[0]['msg']}") from exc


# --------------------------------------------------------------------------------------- batches
@dataclass
class Batch:
    step: int
    ids: torch.Tensor  # [B, T] long, right-padded
    mask: torch.Tensor  # [B, T] bool
    old_logprobs: torch.Tensor  # [B, T] float
    advantages: torch.Tensor  # [B] float
    temperature: torch.Tensor  # [B] float
    rewards: list[float] | None  # optional extra field "reward", for the log line only

    @property
    def n_tokens(self) -> int:
        return int(self.mask.sum())


_REQUIRED = ("token_ids", "mask", "logprobs", "advantage", "temperature")


def parse_batch(raw: bytes, expected_step: int, where: str = "batch") -> Batch:
    """Validate and tensorize a format-1 batch; raises :class:`TrainerError` naming the problem."""
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise TrainerError(f"{where}: not valid JSON ({exc})") from exc
    if not isinstance(doc, dict):
        raise TrainerError(f"{where}: top level must be an object")
    if doc.get("format") != files.BATCH_FORMAT:
        raise TrainerError(f"{where}: format must be {files.BATCH_FORMAT}, got {doc.get('format')!r}")
    if doc.get("step") != expected_step:
        raise TrainerError(f"{where}: step must be {expected_step}, got {doc.get('step')!r}")
    samples = doc.get("samples")
    if not isinstance(samples, list):
        raise TrainerError(f"{where}: 'samples' must be a list")
    seqs, masks, lps, advs, temps, rewards = [], [], [], [], [], []
    for i, s in enumerate(samples):
        tag = f"{where}: sample {i} (trace_id {s.get('trace_id') if isinstance(s, dict) else '?'})"
        if not isinstance(s, dict):
            raise TrainerError(f"{tag}: must be an object")
        missing = [k for k in _REQUIRED if k not in s]
        if missing:
            raise TrainerError(f"{tag}: missing field(s) {missing}")
        ids, mask, lp = s["token_ids"], s["mask"], s["logprobs"]
        if not (isinstance(ids, list) and isinstance(mask, list) and isinstance(lp, list)):
            raise TrainerError(f"{tag}: token_ids, mask and logprobs must be lists")
        if not (len(ids) == len(mask) == len(lp)) or len(ids) < 2:
            raise TrainerError(
                f"{tag}: token_ids/mask/logprobs lengths differ or < 2 ({len(ids)}, {len(mask)}, {len(lp)})"
            )
        if any(not isinstance(t, int) or not 0 <= t < VOCAB_SIZE for t in ids):
            raise TrainerError(f"{tag}: token id outside [0, {VOCAB_SIZE})")
        if any(m not in (0, 1) for m in mask) or mask[0] != 0:
            raise TrainerError(f"{tag}: mask must be 0/1 with mask[0] == 0")
        if any(not isinstance(x, (int, float)) for x in lp) or any(
            m and not x <= 0.0 for m, x in zip(mask, lp)
        ):
            raise TrainerError(f"{tag}: logprobs must be numbers <= 0 on sampled tokens")
        adv, temp = s["advantage"], s["temperature"]
        if not isinstance(adv, (int, float)) or adv != adv or abs(adv) == float("inf"):
            raise TrainerError(f"{tag}: advantage must be a finite number, got {adv!r}")
        if not isinstance(temp, (int, float)) or not temp > 0:
            raise TrainerError(f"{tag}: temperature must be > 0, got {temp!r}")
        seqs.append(ids)
        masks.append(mask)
        lps.append([float(x) for x in lp])
        advs.append(float(adv))
        temps.append(float(temp))
        if isinstance(s.get("reward"), (int, float)):
            rewards.append(float(s["reward"]))
    if not seqs:
        empty = torch.zeros(0, 2)
        return Batch(expected_step, empty.long(), empty.bool(), empty, torch.zeros(0), torch.ones(0), None)
    width = max(len(x) for x in seqs)
    return Batch(
        step=expected_step,
        ids=pad_batch(seqs),
        mask=torch.tensor([m + [0] * (width - len(m)) for m in masks], dtype=torch.bool),
        old_logprobs=torch.tensor([x + [0.0] * (width - len(x)) for x in lps]),
        advantages=torch.tensor(advs),
        temperature=torch.tensor(temps),
        rewards=rewards if len(rewards) == len(seqs) else None,
    )


# ------------------------------------------------------------------------------------------ loss
def pg_loss(
    new_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped importance-ratio policy-gradient loss (PPO form), mean over sampled tokens.

    ratio = exp(new - old) per token; per-token advantage = the sample's advantage;
    loss_t = -min(ratio * A, clip(ratio, 1-eps, 1+eps) * A). Tokens whose ratio is beyond the clip
    in the direction the advantage pushes get zero gradient.
    """
    mask_f = mask.to(new_logprobs.dtype)
    n = mask_f.sum().clamp(min=1.0)
    log_ratio = torch.where(mask, new_logprobs - old_logprobs, torch.zeros_like(new_logprobs))
    ratio = torch.exp(log_ratio)
    adv = advantages.view(-1, 1).expand_as(ratio)
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps) * adv
    loss = -(torch.minimum(unclipped, clipped) * mask_f).sum() / n
    with torch.no_grad():
        clipfrac = (((ratio - 1.0).abs() > clip_eps) & mask).sum().item() / n.item()
        kl = (((ratio - 1.0) - log_ratio) * mask_f).sum().item() / n.item()  # k3 estimator
        rmax = ratio[mask].max().item() if bool(mask.any()) else 1.0
    return loss, {"clipfrac": clipfrac, "kl": kl, "ratio_max": rmax}


# ---------------------------------------------------------------------------------- parent watch
def _parent_alive(pid: int, initial_ppid: int) -> bool:
    if pid == initial_ppid and os.getppid() != pid:
        return False  # we were re-parented: our parent is gone
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a dead but unreaped parent is a zombie
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


def start_parent_watchdog(pid: int, period_s: float = 0.2) -> threading.Thread:
    """Daemon thread: when ``pid`` dies, print a line and ``os._exit(3)`` (all writes are atomic,
    so dying mid-write only leaves temp files, cleaned at the next start)."""
    initial_ppid = os.getppid()

    def watch() -> None:
        while True:
            if not _parent_alive(pid, initial_ppid):
                print(f"orch trainer: parent process {pid} is gone; exiting", file=sys.stderr, flush=True)
                os._exit(EXIT_PARENT_DIED)
            time.sleep(period_s)

    t = threading.Thread(target=watch, name="orch-trainer-parent-watch", daemon=True)
    t.start()
    return t


# --------------------------------------------------------------------------------------- trainer
@dataclass
class StepStats:
    step: int
    loss: float
    adv_mean: float
    adv_abs_mean: float
    samples: int
    tokens: int
    clipfrac: float
    kl: float
    ratio_max: float
    grad_norm: float
    reward_mean: float | None
    wait_s: float
    train_s: float
    entropy: float | None = None  # mean negative logprob of the sampled tokens under the trainer's policy

    def metrics(self, learning_rate: float) -> dict[str, float]:
        """The step's figures for weights/step_N/metrics.json (rundir.TRAINER_METRICS)."""
        out = {"loss": self.loss, "grad_norm": self.grad_norm, "mismatch_kl": self.kl, "tokens": self.tokens,
               "learning_rate": learning_rate, "step_time_s": self.train_s}
        return out if self.entropy is None else {**out, "entropy": self.entropy}

    def line(self) -> str:
        rew = f" reward={self.reward_mean:.3f}" if self.reward_mean is not None else ""
        return (
            f"trainer step={self.step} loss={self.loss:+.4f} adv_mean={self.adv_mean:+.4f} "
            f"adv_abs={self.adv_abs_mean:.4f} samples={self.samples} tokens={self.tokens}{rew} "
            f"clipfrac={self.clipfrac:.3f} kl={self.kl:.2e} ratio_max={self.ratio_max:.3f} "
            f"grad_norm={self.grad_norm:.3f} wait={self.wait_s:.2f}s train={self.train_s:.3f}s"
        )


class Trainer:
    """The trainer's state and steps, usable in-process (simulate, tests) or via :func:`run_trainer`."""

    def __init__(self, run_dir: str | os.PathLike, config: TrainerConfig, log: Callable[[str], None] | None = None):
        self.run_dir = Path(run_dir)
        self.config = config
        self.log = log or (lambda s: print(s, flush=True))
        self.model: Policy | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.step = -1  # last trained step (0 = warm start done)

    # -- setup ---------------------------------------------------------------------------------
    def _new_optimizer(self, model: Policy) -> torch.optim.Optimizer:
        return torch.optim.Adam(model.parameters(), lr=self.config.lr)

    def init_or_resume(self) -> int:
        """Load the checkpoint, or build + warm-start + checkpoint + publish step 0. Returns the
        last trained step."""
        for d in (files.weights_root(self.run_dir), files.ckpt_dir(self.run_dir)):
            files.clean_tmp(d)
        path = files.ckpt_dir(self.run_dir) / files.CKPT_FILE
        if path.is_file():
            ck = torch.load(path, map_location="cpu", weights_only=True)
            saved = PolicyConfig.model_validate(ck["policy"])
            if saved != self.config.policy:
                raise TrainerError(
                    f"checkpoint {path} was made with policy {saved.model_dump()}, "
                    f"config says {self.config.policy.model_dump()}"
                )
            self.model = Policy(saved)
            self.model.load_state_dict(ck["model"])
            self.optimizer = self._new_optimizer(self.model)
            self.optimizer.load_state_dict(ck["optimizer"])
            self.step = int(ck["step"])
            self.log(f"trainer resumed from {path} at step {self.step}")
        else:
            t0 = time.perf_counter()
            self.model = build_policy(self.config.policy, seed=self.config.seed)
            stats = warm_start(self.model, self.config)
            self.optimizer = self._new_optimizer(self.model)
            self.step = 0
            self.save_checkpoint()
            self.log(
                f"trainer warm start: {stats['steps']} steps, loss {stats['loss']:.3f}, "
                f"sampled reward {stats['reward']:.3f} (n={stats['n']}) in {time.perf_counter() - t0:.1f}s"
            )
        self.publish(self.step)
        return self.step

    # -- one RL step ---------------------------------------------------------------------------
    def lr_at(self, step: int) -> float:
        """Learning rate of RL step ``step`` (1-based): linear warmup, then constant."""
        warm = self.config.lr_warmup_steps
        return self.config.lr * (min(1.0, step / warm) if warm > 0 else 1.0)

    def train_on_batch(self, batch: Batch) -> StepStats:
        """ONE optimizer step on ``batch`` (does not checkpoint or publish)."""
        assert self.model is not None and self.optimizer is not None
        t0 = time.perf_counter()
        model = self.model
        model.train()
        for p in model.parameters():
            p.requires_grad_(True)
        n_samples = int(batch.ids.shape[0])
        if batch.n_tokens == 0:
            loss_v, info, gnorm, entropy = 0.0, {"clipfrac": 0.0, "kl": 0.0, "ratio_max": 1.0}, 0.0, 0.0
            self.log(f"trainer step={batch.step}: batch has no sampled tokens; weights unchanged")
        else:
            new_lp = token_logprobs(model, batch.ids, batch.temperature)
            loss, info = pg_loss(new_lp, batch.old_logprobs, batch.advantages, batch.mask, self.config.clip_eps)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), self.config.grad_clip))
            for group in self.optimizer.param_groups:
                group["lr"] = self.lr_at(batch.step)
            self.optimizer.step()
            loss_v = float(loss.detach())
            entropy = float(-(new_lp.detach() * batch.mask).sum() / batch.n_tokens)
        model.eval()
        adv = batch.advantages
        return StepStats(
            step=batch.step,
            loss=loss_v,
            adv_mean=float(adv.mean()) if n_samples else 0.0,
            adv_abs_mean=float(adv.abs().mean()) if n_samples else 0.0,
            samples=n_samples,
            tokens=batch.n_tokens,
            clipfrac=info["clipfrac"],
            kl=info["kl"],
            ratio_max=info["ratio_max"],
            grad_norm=gnorm,
            entropy=entropy,
            reward_mean=(sum(batch.rewards) / len(batch.rewards)) if batch.rewards else None,
            wait_s=0.0,
            train_s=time.perf_counter() - t0,
        )

    def train_step(self, step: int, wait: bool = True) -> StepStats:
        """Wait for batch ``step``, train on it, checkpoint, publish ``weights/step_{step}``."""
        if step != self.step + 1:
            raise TrainerError(f"trainer is at step {self.step}; cannot train step {step}")
        t0 = time.perf_counter()
        path = files.batch_path(self.run_dir, step)
        if wait:
            self.wait_for(path)
        wait_s = time.perf_counter() - t0
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            raise TrainerError(f"batch file {path} does not exist") from None
        stats = self.train_on_batch(parse_batch(raw, step, where=str(path)))
        stats.wait_s = wait_s
        self.step = step
        self.save_checkpoint()
        self.publish(step, stats.metrics(self.lr_at(step)))
        return stats

    def wait_for(self, path: Path) -> None:
        cfg = self.config
        if path.is_file():
            return
        start = time.monotonic()
        # say what we wait for: at once for the first batch, else only if the wait gets long
        next_note = start if self.step == 0 else start + 2.0
        while not path.is_file():
            now = time.monotonic()
            if now - start > cfg.batch_wait_timeout_s:
                raise TrainerError(
                    f"timed out after {cfg.batch_wait_timeout_s:.0f}s waiting for {path} "
                    f"(newest published version: {self.step})"
                )
            if now >= next_note:
                self.log(
                    f"trainer waiting for {path} ({now - start:.0f}s so far, "
                    f"timeout {cfg.batch_wait_timeout_s:.0f}s)"
                )
                next_note = now + 10.0
            time.sleep(cfg.poll_interval_s)

    # -- files -----------------------------------------------------------------------------------
    def save_checkpoint(self) -> None:
        assert self.model is not None and self.optimizer is not None
        import io

        buf = io.BytesIO()
        torch.save(
            {
                "format": 1,
                "step": self.step,
                "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "policy": self.config.policy.model_dump(),
            },
            buf,
        )
        files.atomic_write_bytes(files.ckpt_dir(self.run_dir) / files.CKPT_FILE, buf.getvalue())

    def publish(self, version: int, metrics: dict[str, float] | None = None) -> Path:
        """weights/step_{version} (atomic dir), its metrics.json, then STABLE, then prune old
        versions. Idempotent."""
        assert self.model is not None
        wdir = files.weights_dir(self.run_dir, version)
        if not files.is_stable(wdir):
            if wdir.exists():  # a leftover without STABLE: incomplete from an earlier crash
                files.remove_dir_safely(wdir)
            save_weights(self.model, wdir)
            if metrics is not None:
                files.write_metrics(wdir, metrics)
            files.mark_stable(wdir)
        self.prune_weights(version)
        return wdir

    def prune_weights(self, newest: int) -> None:
        root = files.weights_root(self.run_dir)
        for p in list(root.iterdir()):
            if p.name.startswith("step_") and p.name[5:].isdigit():
                if int(p.name[5:]) <= newest - self.config.keep_weights:
                    files.remove_dir_safely(p)

    # -- the loop --------------------------------------------------------------------------------
    def run(self) -> None:
        self.init_or_resume()
        if self.step >= self.config.max_steps:
            self.log(f"trainer: already at step {self.step} >= max_steps {self.config.max_steps}; done")
            return
        for step in range(self.step + 1, self.config.max_steps + 1):
            self.log(self.train_step(step).line())
        self.log(f"trainer done: {self.config.max_steps} steps")


# ------------------------------------------------------------------------------------ warm start
def sft_batch(config: TrainerConfig, start_index: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    env = ReverseTextEnv(seed=config.sft_env_seed, min_len=config.env_min_len, max_len=config.env_max_len)
    seqs, masks = [], []
    for i in range(start_index, start_index + size):
        task = env.task(i)
        p, c = encode_prompt(task.prompt), encode_completion(task.answer)
        seqs.append(p + c)
        masks.append([0] * len(p) + [1] * len(c))
    width = max(len(s) for s in seqs)
    return pad_batch(seqs), torch.tensor([m + [0] * (width - len(m)) for m in masks], dtype=torch.bool)


def warm_start(model: Policy, config: TrainerConfig, eval_n: int = 64) -> dict[str, Any]:
    """Supervised warm start (teacher forcing on prompt -> tags + reversed + EOS), then a sampled
    reward estimate on ``eval_n`` held-out tasks. Deliberately short (stops at ``sft_stop_loss``):
    a partial solution, so that RL has room to improve."""
    opt = torch.optim.Adam(model.parameters(), lr=config.sft_lr)
    model.train()
    ema = None
    steps = 0
    for k in range(config.sft_steps):
        ids, mask = sft_batch(config, k * config.sft_batch_size, config.sft_batch_size)
        lp = token_logprobs(model, ids, 1.0)
        loss = -(lp * mask).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        steps += 1
        ema = float(loss.detach()) if ema is None else 0.7 * ema + 0.3 * float(loss.detach())
        if config.sft_stop_loss is not None and ema <= config.sft_stop_loss:
            break
    model.eval()
    env = ReverseTextEnv(seed=config.sft_env_seed + 1, min_len=config.env_min_len, max_len=config.env_max_len)
    tasks = [env.task(i) for i in range(max(eval_n // 8, 1))]
    groups = sample_groups(
        model, [t.prompt for t in tasks], 8, temperature=config.temperature,
        max_new_tokens=config.max_new_tokens, seeds=list(range(len(tasks))),
    )
    rewards = [env.score(t, c.text) for t, g in zip(tasks, groups) for c in g]
    return {"loss": ema if ema is not None else float("nan"), "steps": steps,
            "reward": sum(rewards) / len(rewards), "n": len(rewards)}


# ------------------------------------------------------------------------------------ entrypoints
def exit_code_of(body: Callable[[], None], where: str = "") -> int:
    """Run `body` and turn its outcome into the trainer's exit code: 0, 130 on interrupt, or 1
    after a one-line `orch trainer: error: ...` summary (what the orchestrator quotes) plus the
    traceback (none for a setup mistake). Every failure is reported, never swallowed."""
    try:
        body()
        return EXIT_OK
    except KeyboardInterrupt:
        print(f"orch trainer: {where}interrupted", file=sys.stderr, flush=True)
        return 130
    except Exception as exc:  # noqa: BLE001 - reported in full just below
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        print(f"orch trainer: error: {where}{msg}", file=sys.stderr, flush=True)
        if not isinstance(exc, TrainerSetupError):
            traceback.print_exc(file=sys.stderr)
            sys.stderr.flush()
        return EXIT_ERROR


def run_trainer(run_dir: str | os.PathLike) -> int:
    """Run the trainer to completion in this process; returns the exit code (0 ok, 1 error)."""

    def body() -> None:
        config = read_trainer_config(run_dir)
        if config.parent_pid is not None:
            start_parent_watchdog(config.parent_pid)
        torch.set_num_threads(config.num_threads)
        Trainer(run_dir, config).run()

    return exit_code_of(body)


@click.command("trainer")
@click.option(
    "--run-dir",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="run directory holding trainer.json, batches/ and weights/",
)
def trainer_command(run_dir: Path) -> None:
    """Embedded trainer process: batches/step_N.json -> weights/step_N (+ STABLE)."""
    sys.exit(run_trainer(run_dir))


if __name__ == "__main__":  # python -m orchestrator.embedded.trainer --run-dir DIR
    trainer_command()
