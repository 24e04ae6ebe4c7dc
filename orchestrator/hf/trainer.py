"""The `hf` trainer: a torch process that turns batch files into weight versions of an HF model.

Run as ``orch trainer --run-dir RUN_DIR`` (one process) or, N ranks, as
``torchrun ... -m orchestrator.hf.trainer --run-dir RUN_DIR`` (:func:`.distributed.torchrun_command`).
Its configuration is ``RUN_DIR/trainer.json`` (:class:`.config.TrainerConfig`, written by the orchestrator).

1. Start: load ``AutoModelForCausalLM`` from ``model_path`` (LoRA: wrap it with a PEFT adapter
   whose B matrices start at zero, so step 0 is the base model), or resume from
   ``trainer_ckpt/ckpt.pt`` (weights, AdamW state, step); publish the current version if its
   publication had not completed (step_0: the model as loaded).
2. For N = last_step+1 .. max_steps: wait (bounded) for ``batches/step_N.safetensors``, take ONE AdamW
   step (by default; trainer.hf.loss may ask for several) of :func:`.loss.policy_loss` on it, checkpoint step N,
   publish ``weights/step_N`` (+ ``metrics.json``) then its STABLE marker, prune old versions.
3. Exit 0 after max_steps. An error: one line ``orch trainer: error: ...`` on stderr, then the
   traceback, exit 1. If the orchestrator (``parent_pid``) or the torchrun agent dies, exit 3.

Every rank runs the same loop (:class:`.distributed.Ranks` does the collective parts); rank 0
alone writes files and logs. stdout: one line per step and per notable wait.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
from pydantic import ValidationError

from orchestrator import rundir
from orchestrator.hf import checkpoint
from orchestrator.hf.batch import Batch, BatchError, parse_batch
from orchestrator.hf.config import TrainerConfig
from orchestrator.hf.distributed import Ranks
from orchestrator.hf.loss import (
    MAX_STATS,
    Counts,
    batch_metrics,
    k3,
    masked_log_ratio,
    merge_stats,
    mini_batches,
    policy_loss,
    token_logprobs,
)
from orchestrator.hf.model import ModelError, check_lora_targets, load_model, load_tokenizer
from orchestrator.hf.process import TrainerError, TrainerSetupError, exit_code_of, start_parent_watchdog
from orchestrator.hf.publish import prune, publish


def write_trainer_config(run_dir: str | os.PathLike, config: TrainerConfig) -> Path:
    path = Path(run_dir) / rundir.TRAINER_CONFIG_FILE
    rundir.atomic_write_bytes(path, config.model_dump_json(indent=2).encode())
    return path


def read_trainer_config(run_dir: str | os.PathLike) -> TrainerConfig:
    path = Path(run_dir) / rundir.TRAINER_CONFIG_FILE
    if not path.is_file():
        raise TrainerSetupError(f"no trainer config at {path} (the orchestrator writes it before spawning)")
    try:
        return TrainerConfig.model_validate_json(path.read_bytes())
    except ValidationError as exc:
        raise TrainerSetupError(f"invalid {path}: {exc.errors()[0]['loc']}: {exc.errors()[0]['msg']}") from exc


def import_model_classes() -> None:
    """What `load_tokenizer` and `load_model` import on first use (transformers' auto classes),
    imported now: by a trainer started before its run (`orch trainer --wait-for-start`), while
    the orchestrator checks the model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401


def build_model(config: TrainerConfig):
    """The model to train: the HF model at model_path, with a fresh LoRA adapter if asked."""
    try:
        model = load_model(config.model_path)
    except (OSError, ValueError) as err:
        raise TrainerSetupError(f"model.path {config.model_path} does not load: {str(err).splitlines()[0]}") from None
    lora = config.lora
    if lora.rank == 0:
        return model
    from peft import LoraConfig, get_peft_model

    check_lora_targets(model, lora.target_modules, config.model_path)
    torch.manual_seed(config.seed)  # the A matrices: the same on every rank and every start
    return get_peft_model(
        model,
        LoraConfig(
            r=lora.rank,
            lora_alpha=lora.alpha,
            target_modules=lora.target_modules,
            lora_dropout=0.0,
            bias="none",
            task_type="CAUSAL_LM",
        ),
    )


def reference_model(config: TrainerConfig, device: torch.device):
    """The KL reference as a model of its own: the starting weights of full fine-tuning (None
    without a reference, and with LoRA, whose base with the adapter off is the reference)."""
    if config.loss.kl_reference == "none" or config.lora.rank:
        return None
    reference = load_model(config.model_path).to(device).eval()
    reference.requires_grad_(False)
    return reference


class TrainingLoop:
    """One rank of the trainer (the only one by default); usable in-process by tests."""

    def __init__(self, run_dir: str | os.PathLike, config: TrainerConfig, ranks: Ranks | None = None, log=None):
        self.run_dir, self.config = Path(run_dir), config
        self.ranks = ranks or Ranks()
        self._log = log or (lambda line: print(line, flush=True))
        self.step = -1  # last trained step (0 = nothing trained yet)
        self.pusher = None  # the weight push's sender and service (config.push_weights; main rank)
        self._push_held = False  # every rank: the sender holds the newest version

    def log(self, line: str) -> None:
        if self.ranks.is_main:
            self._log(line)

    # -- setup ---------------------------------------------------------------------------------
    def init_or_resume(self) -> int:
        """Load the model (and the checkpoint, if any), wrap it for the ranks, publish the
        current version. Returns the last trained step."""
        config, ranks = self.config, self.ranks
        if ranks.is_main:
            for directory in (rundir.weights_root(self.run_dir), rundir.ckpt_dir(self.run_dir)):
                rundir.clean_tmp(directory)
        try:
            self.tokenizer = load_tokenizer(config.model_path)
            self.model = build_model(config)
        except ModelError as err:
            raise TrainerSetupError(str(err)) from None
        try:
            ckpt = checkpoint.read(self.run_dir)
        except ValueError as err:
            raise TrainerSetupError(str(err)) from None
        if ckpt is not None:
            if config.model_hash and ckpt.get("model_hash") != config.model_hash:
                raise TrainerSetupError(
                    f"the checkpoint in {checkpoint.path(self.run_dir)} was trained from another "
                    f"model than the one now at {config.model_path}"
                )
            checkpoint.load_weights(self.model, ckpt)
        self.vocab_size = self.model.get_input_embeddings().num_embeddings
        self.reference = reference_model(config, self.ranks.device)
        self.module = ranks.wrap(self.model, config.distributed)
        params = [p for p in self.module.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
        if ckpt is not None:
            checkpoint.load_optimizer(self.module, self.optimizer, ckpt)
            self.step = int(ckpt["step"])
            self.log(f"trainer resumed from {checkpoint.path(self.run_dir)} at step {self.step}")
        else:
            self.step = 0
            self.save_checkpoint()
        n_train = sum(p.numel() for p in params)
        how = f"LoRA rank {config.lora.rank}" if config.lora.rank else "full"
        self.log(
            f"trainer: {config.model_path} ({how}, "
            f"{n_train} trained parameters), {ranks.world} rank(s) ({ranks.backend}, {ranks.device.type}"
            f"{', ' + config.distributed if ranks.world > 1 else ''}), at step {self.step}"
        )
        if config.push_weights and ranks.is_main:
            self.pusher = start_push_service(self.run_dir, config, ranks.device)
        self.publish(self.step, None)
        return self.step

    # -- one RL step ---------------------------------------------------------------------------
    def lr_at(self, step: int) -> float:
        """Learning rate of RL step `step` (1-based): linear warmup, then constant."""
        warm = self.config.lr_warmup_steps
        return self.config.lr * (min(1.0, step / warm) if warm > 0 else 1.0)

    def train_on_batch(self, batch: Batch) -> dict:
        """The optimizer steps of `batch` (this rank's shard of it; one step by default, see
        trainer.hf.loss); returns the batch's metrics."""
        t0 = time.perf_counter()
        ranks, options = self.ranks, self.config.loss
        total_tokens = batch.n_tokens  # the whole batch's: every rank computes the same number
        lr = self.lr_at(batch.step)
        steps: list[dict[str, float]] = []  # each optimizer step's stats (reduced over the ranks)
        first_pass: dict[str, float] = {}  # each token once: the first epoch's steps
        old_pass: dict[str, float] = {}
        if total_tokens == 0:
            self.log(f"trainer step={batch.step}: batch has no sampled tokens; weights unchanged")
        else:
            minis = mini_batches(batch, options.mini_batches)
            # each mini-batch's micro-batches of this rank, cut once for every pass over them
            shards = [ranks.shard(mini, self.config.micro_batch_size) for mini in minis]
            old = self._old_logprobs(shards, old_pass) if options.needs_old_policy() else None
            for epoch in range(options.epochs):
                for m, mini in enumerate(minis):
                    step = self._optimizer_step(mini, shards[m], old[m] if old is not None else None, lr)
                    if step is None:
                        continue  # no samples in this mini-batch
                    steps.append(step)
                    if epoch == 0:
                        first_pass = merge_stats(first_pass, step)
            skipped = sum(1 for step in steps if step["skipped"])
            if steps and skipped == len(steps):
                self.log(f"trainer step={batch.step}: every sampled token was masked; weights unchanged")
        metrics = batch_metrics(batch, steps, first_pass, old_pass, total_tokens, options.kl_reference != "none")
        delay = self.config.min_step_time_s - (time.perf_counter() - t0)
        if delay > 0:
            time.sleep(delay)  # a slowed trainer (trainer.hf.min_step_time_s)
        return metrics | {"lr": lr, "step_time_s": time.perf_counter() - t0, "ranks": ranks.world}

    def _optimizer_step(
        self, mini: Batch, chunks: list[Batch], old: list[torch.Tensor] | None, lr: float
    ) -> dict[str, float] | None:
        """One optimizer step on the mini-batch `mini` (accumulated over `chunks`, this rank's
        micro-batches of it); its stats over every rank. None if it has no sampled token; a step
        whose every token is masked is not taken (``skipped``)."""
        ranks, module = self.ranks, self.module
        counts = Counts.of(mini.mask)
        if counts.tokens == 0:
            return None
        self.optimizer.zero_grad(set_to_none=True)
        module.train()
        sums: dict[str, float] = {}
        for k, chunk in enumerate(chunks):
            with ranks.gradient_sync(module, k == len(chunks) - 1):  # reduce once, after the last
                sums = merge_stats(sums, self._backward(chunk, counts, old[k] if old is not None else None))
        summed = [key for key in sorted(sums) if key not in MAX_STATS]
        step = dict(zip(summed, ranks.sum([sums[key] for key in summed]), strict=True))
        maxed = sorted(MAX_STATS)
        step |= dict(zip(maxed, ranks.max([sums[key] for key in maxed]), strict=True))
        step["tokens"] = float(counts.tokens)
        step["skipped"] = float(step["kept"] == 0)
        step["grad_norm"] = 0.0
        if not step["skipped"]:
            step["grad_norm"] = full_value(torch.nn.utils.clip_grad_norm_(module.parameters(), self.config.grad_clip))
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        module.eval()
        return step

    @torch.no_grad()
    def _old_logprobs(self, shards: list[list[Batch]], stats: dict[str, float]) -> list[list[torch.Tensor]]:
        """The trainer's logprobs before this batch's first update (decoupled PPO's proximal
        policy), per mini-batch and micro-batch of this rank (`shards`); adds the exact pre-update
        mismatch (k3 sum) and token count to `stats`."""
        dev, old, k3_sum = self.ranks.device, [], 0.0
        self.module.train()  # as the training passes run
        for chunks in shards:
            per_chunk = []
            for chunk in chunks:
                ids = chunk.ids.to(dev)
                logits = self.module(input_ids=ids, attention_mask=chunk.attention.to(dev)).logits
                lp, _ = token_logprobs(logits, ids, chunk.temperature.to(dev))
                mask = chunk.mask.to(dev)
                log_r = masked_log_ratio(lp, chunk.sampler_logprobs.to(dev), mask)
                k3_sum += float((k3(log_r) * mask).sum())
                per_chunk.append(lp)
            old.append(per_chunk)
        self.module.eval()
        stats["mismatch_k3"] = self.ranks.sum([k3_sum])[0]
        return old

    @torch.no_grad()
    def _reference_logprobs(self, ids: torch.Tensor, chunk: Batch) -> torch.Tensor:
        """The reference policy's logprobs: the starting weights (LoRA: the base, adapter off)."""
        attention = chunk.attention.to(ids.device)
        if self.reference is None:
            with self.model.disable_adapter():
                logits = self.module(input_ids=ids, attention_mask=attention).logits
        else:
            logits = self.reference(input_ids=ids, attention_mask=attention).logits
        return token_logprobs(logits, ids, chunk.temperature.to(ids.device))[0]

    def _backward(self, chunk: Batch, counts: Counts, old_logprobs: torch.Tensor | None) -> dict[str, float]:
        """Forward and backward of one micro-batch; its shares of the mini-batch's loss and
        stats (policy_loss's, plus ``entropy``)."""
        dev, world, options = self.ranks.device, self.ranks.world, self.config.loss
        ids = chunk.ids.to(dev)
        ref = self._reference_logprobs(ids, chunk) if options.kl_reference != "none" else None
        logits = self.module(input_ids=ids, attention_mask=chunk.attention.to(dev)).logits
        new_lp, entropy = token_logprobs(logits, ids, chunk.temperature.to(dev))
        del logits  # the [B, T, vocab] activations are the largest tensors of a step
        mask = chunk.mask.to(dev)
        loss, stats = policy_loss(
            new_lp,
            chunk.sampler_logprobs.to(dev),
            chunk.advantages.to(dev),
            mask,
            self.config.clip_eps,
            options,
            counts,
            old_logprobs=old_logprobs,
            ref_logprobs=ref,
            sample_weights=None if chunk.sample_weights is None else chunk.sample_weights.to(dev),
        )
        (loss * world).backward()  # the ranks' gradients are averaged: see .distributed
        return stats | {"loss": float(loss.detach()), "entropy": float((entropy.detach() * mask).sum())}

    def train_step(self, step: int) -> dict:
        """Wait for batch `step`, train on it, checkpoint, publish ``weights/step_{step}``."""
        if step != self.step + 1:
            raise TrainerError(f"trainer is at step {self.step}; cannot train step {step}")
        t0 = time.perf_counter()
        path = rundir.batch_path(self.run_dir, step)
        self.wait_for(path)
        wait_s = time.perf_counter() - t0
        try:
            batch = parse_batch(path.read_bytes(), step, self.vocab_size, where=str(path))
        except BatchError as err:
            raise TrainerError(str(err)) from None
        metrics = self.train_on_batch(batch)
        metrics["wait_s"] = wait_s
        self.refuse_nonfinite(step)  # before the checkpoint: the last one stays the last good step
        self.step = step
        self.save_checkpoint()
        self.publish(step, metrics, checked=True)
        return metrics

    def wait_for(self, path: Path) -> None:
        cfg = self.config
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
                    f"trainer waiting for {path} ({now - start:.0f}s so far, timeout {cfg.batch_wait_timeout_s:.0f}s)"
                )
                next_note = now + 10.0
            time.sleep(cfg.poll_interval_s)

    # -- files ---------------------------------------------------------------------------------
    def save_checkpoint(self) -> None:
        checkpoint.save(
            self.run_dir, self.module, self.optimizer, self.step, self.config.model_hash, write=self.ranks.is_main
        )

    def refuse_nonfinite(self, step: int) -> None:
        """TrainerError (one line; the run stops, resumable from the last checkpoint) if training
        on batch `step` left a trained parameter NaN or infinite: such weights are never
        checkpointed or published. Every rank counts its part (its shard, under FSDP) and all
        decide on the largest count, together."""
        trained = [p for p in self.module.parameters() if p.requires_grad]
        [bad] = self.ranks.max([float(checkpoint.nonfinite_count(trained))])
        if bad:
            raise TrainerError(
                f"training on batch {step} left {int(bad)} non-finite values in the trained weights: not "
                f"checkpointed or published (the checkpoint stays at step {self.step}); see the step's "
                "loss, lower trainer.hf.lr or check the batch, then resume"
            )

    def publish(self, version: int, metrics: dict | None, checked: bool = False) -> None:
        """Publish the weights as `version` unless they are already; `checked`: the step that made
        them has just refused non-finite ones (`refuse_nonfinite`), so they are not scanned again.
        A republish (at start) scans them: its checkpoint may predate that check. Whether they are
        already published is the main rank's answer, given to every rank before it writes: a rank
        that looked for itself after the main rank wrote STABLE would skip the collectives below."""
        seen = self.ranks.is_main and rundir.is_stable(rundir.weights_dir(self.run_dir, version))
        [stable] = self.ranks.max([float(seen)])
        if stable and (self._push_held or not self.config.push_weights):
            return  # every rank has the same answer: none gathers
        state = checkpoint.trained_state_dict(self.module)  # collective under FSDP
        if not stable:
            self.write_version(version, state, metrics, checked)
        if self.config.push_weights:
            # After STABLE: the sender holds published versions only, so a push never gets ahead of
            # the log (a load asked for meanwhile waits for it, within its bound).
            if self.pusher is not None:
                self.pusher.sender.set_version(version, state.items())
            self._push_held = True
        self.ranks.barrier()

    def write_version(self, version: int, state: dict, metrics: dict | None, checked: bool) -> None:
        """weights/step_{version} and its STABLE marker, once its weights are known finite."""
        if checked:
            bad = 0.0
        else:
            [bad] = self.ranks.max([float(checkpoint.nonfinite_count(state.values())) if self.ranks.is_main else 0.0])
        if bad:  # a checkpoint written before its weights were checked: never published
            raise TrainerError(
                f"the weights of version {version} hold {int(bad)} non-finite values: not published; "
                f"restore {checkpoint.path(self.run_dir)} from a backup, or start a new run"
            )
        if self.ranks.is_main:
            publish(self.run_dir, version, self.model, self.tokenizer, state, metrics)
            prune(self.run_dir, version, self.config.keep_weights)

    # -- the loop ------------------------------------------------------------------------------
    def run(self) -> None:
        try:
            self.init_or_resume()
            if self.step >= self.config.max_steps:
                self.log(f"trainer: already at step {self.step} >= max_steps {self.config.max_steps}; done")
                return
            for step in range(self.step + 1, self.config.max_steps + 1):
                self.log(step_line(self.train_step(step)))
            self.log(f"trainer done: {self.config.max_steps} steps")
        finally:
            if self.pusher is not None:
                self.pusher.close()


def start_push_service(run_dir: Path, config: TrainerConfig, device: torch.device):
    """The weight push's sender and its HTTP service (orchestrator/weight_push), its address in
    RUN_DIR/weights/push.json; its transport NCCL where the trainer is on a GPU (auto)."""
    from orchestrator.weight_push import PUSH_INFO
    from orchestrator.weight_push.sender import PushService, WeightPushSender
    from orchestrator.weight_push.transport import transport_named

    push = config.push
    name = push.transport if push.transport != "auto" else ("nccl" if device.type == "cuda" else "gloo")
    sender = WeightPushSender(
        transport_named(name, config.push_bucket_bytes),
        host=push.host,
        timeout_s=push.timeout_s,
        push_timeout_s=config.batch_wait_timeout_s,
        wire_dtype=getattr(torch, push.dtype) if push.dtype else None,
    )
    root = rundir.weights_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    return PushService(sender, root / PUSH_INFO, host=push.host)


def full_value(norm: torch.Tensor) -> float:
    """A grad norm as a float (FSDP2 returns it as a DTensor)."""
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


def step_line(m: dict) -> str:
    reward = f" reward={m['reward_mean']:.3f}" if "reward_mean" in m else ""
    per_episode = m.get("samples_per_episode", 1.0)
    samples = f"{m['samples']}" if per_episode == 1.0 else f"{m['samples']} ({per_episode:.2f} per episode)"
    return (
        f"trainer step={m['step']} loss={m['loss']:+.4f} grad_norm={m['grad_norm']:.3f} "
        f"entropy={m['entropy']:.3f} mismatch_kl={m['mismatch_kl']:.2e} clipfrac={m['clipfrac']:.3f} "
        f"samples={samples} tokens={m['tokens']}{reward} lr={m['lr']:.2e} wait={m['wait_s']:.2f}s "
        f"train={m['step_time_s']:.3f}s ranks={m['ranks']}"
    )


def run_trainer(run_dir: str | os.PathLike) -> int:
    """Run this rank of the trainer to completion; returns the exit code (0 ok, 1 error)."""
    rank = os.environ.get("RANK")

    def body() -> None:
        config = read_trainer_config(run_dir)
        if config.parent_pid is not None:
            start_parent_watchdog(config.parent_pid)
        if rank is not None:
            start_parent_watchdog(os.getppid())  # the torchrun agent: never outlive it
        torch.set_num_threads(config.num_threads)
        ranks = Ranks.from_env(config.backend, timeout_s=config.batch_wait_timeout_s + 120)
        try:
            TrainingLoop(run_dir, config, ranks).run()
            ranks.barrier()  # the last publication is done before any rank reports success
        finally:
            ranks.close()

    return exit_code_of(body, where="" if rank is None else f"[rank {rank}] ")
