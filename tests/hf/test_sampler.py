"""The in-process sampler: its logprobs are the ones the trainer recomputes at equal weights
(k3 KL < 1e-3), its rows do not depend on their batch, and it stops at the end-of-turn token."""

from __future__ import annotations

import random

import pytest
import torch

from orchestrator.hf.loss import token_logprobs
from orchestrator.hf.model import render_prompt
from orchestrator.hf.sampler import sample
from orchestrator.hf.tiny_model import build_untrained, sft_batch, sft_examples

PROMPTS = ["abc", "hgfedc", "bbaa", "cdefgh"]


@pytest.fixture(scope="module")
def warm():
    """The tiny model after a few supervised steps: a peaked distribution that ends its answers
    with the end-of-turn token, as the run's model does."""
    model, tokenizer = build_untrained(seed=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rng = random.Random(1)
    for _ in range(30):
        ids, attention, labels = sft_batch(tokenizer, sft_examples(rng, 32, 3, 6))
        model(input_ids=ids, attention_mask=attention, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.eval(), tokenizer


def _draw(model, tokenizer, temperature: float, seeds=range(16)):
    prompts = [
        render_prompt(tokenizer, text, [{"role": "user", "content": text}]) for text in PROMPTS for _ in range(4)
    ]
    return prompts, sample(
        model,
        prompts,
        list(seeds),
        temperature=temperature,
        max_new_tokens=40,
        eos_id=tokenizer.eos_token_id,
        pad_id=tokenizer.pad_token_id,
    )


@torch.no_grad()
def _recomputed(model, prompt: list[int], completion: list[int], temperature: float) -> list[float]:
    ids = torch.tensor([prompt + completion])
    lp, _ = token_logprobs(model(input_ids=ids).logits, ids, torch.tensor([temperature]))
    return lp[0, len(prompt) :].tolist()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_are_the_trainers_at_equal_weights(warm, temperature, capsys):
    model, tokenizer = warm
    prompts, results = _draw(model, tokenizer, temperature)
    sampled = torch.tensor([x for _, lps in results for x in lps])
    recomputed = torch.tensor(
        [x for p, (ids, _) in zip(prompts, results) for x in _recomputed(model, p, ids, temperature)]
    )
    log_ratio = recomputed - sampled
    k3 = float((log_ratio.exp() - 1 - log_ratio).mean())
    with capsys.disabled():
        print(
            f"\nsampler vs trainer at T={temperature}: k3 KL {k3:.2e}, max |dlogprob| "
            f"{float(log_ratio.abs().max()):.2e} over {len(sampled)} tokens"
        )
    assert k3 < 1e-3 and float(log_ratio.abs().max()) < 1e-3
    ended = [ids for ids, _ in results if len(ids) < 40]
    assert ended and all(ids[-1] == tokenizer.eos_token_id for ids in ended)  # a row stops at <|im_end|>
    assert all(tokenizer.eos_token_id not in ids[:-1] for ids, _ in results)


def test_the_check_catches_a_temperature_mismatch(warm):
    """The agreement above can fail: recomputing at another temperature is far off."""
    model, tokenizer = warm
    prompts, results = _draw(model, tokenizer, 1.0)
    gaps = [abs(a - b) for p, (ids, lps) in zip(prompts, results) for a, b in zip(lps, _recomputed(model, p, ids, 0.5))]
    assert max(gaps) > 0.1


def test_a_row_does_not_depend_on_its_batch(warm):
    model, tokenizer = warm
    prompts, batched = _draw(model, tokenizer, 1.0)
    alone = sample(
        model,
        [prompts[5]],
        [5],
        temperature=1.0,
        max_new_tokens=40,
        eos_id=tokenizer.eos_token_id,
        pad_id=tokenizer.pad_token_id,
    )
    assert alone[0][0] == batched[5][0]
    assert alone[0][1] == pytest.approx(batched[5][1], abs=1e-4)


def test_concurrent_callers_are_sampled_in_batches_without_changing_their_results(tmp_path, warm):
    from concurrent.futures import ThreadPoolExecutor

    from orchestrator import rundir
    from orchestrator.hf.sampler import Sampler

    model, tokenizer = warm
    wdir = rundir.weights_dir(tmp_path, 2)
    model.save_pretrained(wdir)
    tokenizer.save_pretrained(wdir)
    rundir.mark_stable(wdir)
    sampler = Sampler(tmp_path, eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id)
    sampler.reload(wdir, 2)
    prompts = [render_prompt(tokenizer, t, [{"role": "user", "content": t}]) for t in PROMPTS * 6]
    with ThreadPoolExecutor(8) as pool:
        futures = [
            pool.submit(sampler.sample_coalesced, p, temperature=1.0, max_new_tokens=30, seed=i)
            for i, p in enumerate(prompts)
        ]
        got = [f.result() for f in futures]
    for i, (prompt, completion) in enumerate(zip(prompts, got)):
        ((solo_ids, solo_lps),) = sample(
            model,
            [prompt],
            [i],
            temperature=1.0,
            max_new_tokens=30,
            eos_id=tokenizer.eos_token_id,
            pad_id=tokenizer.pad_token_id,
        )
        assert completion.version == 2 and completion.token_ids == solo_ids
        assert completion.logprobs == pytest.approx(solo_lps, abs=1e-4)
    assert sampler.batches < len(prompts)  # concurrent requests were actually merged
