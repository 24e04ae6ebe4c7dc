"""Shared helpers of the hf tests: a tiny untrained model dir, batches made from it, and
the trainer variants every shared test runs on (full fine-tuning and LoRA)."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
torch.set_num_threads(1)

from orchestrator.hf.config import LoraSection, TrainerConfig  # noqa: E402
from orchestrator.hf.loss import token_logprobs  # noqa: E402
from orchestrator.hf.tiny_model import answer_ids, build_untrained, render_prompt  # noqa: E402
from orchestrator.hf.trainer import TrainingLoop  # noqa: E402

TEXTS = ["abc", "hgfe", "bbad", "cadhe"]
VARIANTS = {"full": LoraSection(), "lora": LoraSection(rank=4, alpha=8.0)}


def write_untrained(path: Path) -> Path:
    """An untrained tiny model dir (no warm start: these tests need a model, not a good one)."""
    model, tokenizer = build_untrained(seed=0)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def trainer_config(model_dir: Path, variant: str = "full", **kw) -> TrainerConfig:
    base = dict(
        model_path=model_dir,
        max_steps=3,
        lr=1e-2,
        lr_warmup_steps=0,
        lora=VARIANTS[variant],
        batch_wait_timeout_s=20.0,
        poll_interval_s=0.01,
    )
    return TrainerConfig(**(base | kw))


def started_trainer(run_dir: Path, config: TrainerConfig) -> TrainingLoop:
    trainer = TrainingLoop(run_dir, config, log=lambda line: None)
    trainer.init_or_resume()
    return trainer


@torch.no_grad()
def samples(model, tokenizer, advantages: list[float], temperature: float = 1.0) -> list[dict]:
    """Batch-file samples: reverse_text prompts with their reference answers as the sampled
    tokens, their logprobs those of `model` (so every ratio starts at 1)."""
    out = []
    for i, adv in enumerate(advantages):
        text = TEXTS[i % len(TEXTS)]
        prompt, answer = render_prompt(tokenizer, text), answer_ids(tokenizer, text)
        ids = torch.tensor([prompt + answer])
        logits = model(input_ids=ids).logits
        lp, _ = token_logprobs(logits, ids, torch.tensor([temperature]))
        mask = [0] * len(prompt) + [1] * len(answer)
        out.append(
            {
                "sample_id": i,
                "group_id": i // 2,
                "env": "reverse_text",
                "token_ids": prompt + answer,
                "mask": mask,
                "logprobs": [x if m else 0.0 for x, m in zip(lp[0].tolist(), mask)],
                "advantage": adv,
                "policy_start": 0,
                "lag": 0,
                "temperature": temperature,
            }
        )
    return out
