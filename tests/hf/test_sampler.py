"""The in-process sampler: its logprobs are the ones the trainer recomputes at equal weights
(k3 KL < 1e-3), its rows do not depend on their batch, it stops at the end-of-turn token, and a
version that takes over between decode steps (update_mode interrupt) samples every token after
it: each token's logprob is its version's, given everything before it."""

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
    sampled = torch.tensor([x for _, lps, _ in results for x in lps])
    recomputed = torch.tensor(
        [x for p, (ids, _, _) in zip(prompts, results) for x in _recomputed(model, p, ids, temperature)]
    )
    log_ratio = recomputed - sampled
    k3 = float((log_ratio.exp() - 1 - log_ratio).mean())
    with capsys.disabled():
        print(
            f"\nsampler vs trainer at T={temperature}: k3 KL {k3:.2e}, max |dlogprob| "
            f"{float(log_ratio.abs().max()):.2e} over {len(sampled)} tokens"
        )
    assert k3 < 1e-3 and float(log_ratio.abs().max()) < 1e-3
    ended = [ids for ids, _, _ in results if len(ids) < 40]
    assert ended and all(ids[-1] == tokenizer.eos_token_id for ids in ended)  # a row stops at <|im_end|>
    assert all(tokenizer.eos_token_id not in ids[:-1] for ids, _, _ in results)


def test_the_check_catches_a_temperature_mismatch(warm):
    """The agreement above can fail: recomputing at another temperature is far off."""
    model, tokenizer = warm
    prompts, results = _draw(model, tokenizer, 1.0)
    gaps = [
        abs(a - b) for p, (ids, lps, _) in zip(prompts, results) for a, b in zip(lps, _recomputed(model, p, ids, 0.5))
    ]
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
        ((solo_ids, solo_lps, _),) = sample(
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


def _perturbed(model, seed: int):
    """Another version of `model`: its lm_head moved enough that its tokens' logprobs differ."""
    import copy

    other = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        head = other.get_output_embeddings().weight
        head.add_(0.3 * torch.randn(head.shape, generator=g))
    return other.eval()


def _segments_match_their_versions(models, prompts, results, temperature=1.0):
    """Per token, the recomputed logprob under its own version and under the others: (k3 KL,
    max |diff| own, min over tokens of max |diff| to another version)."""
    own, others = [], []
    for prompt, (ids, lps, versions) in zip(prompts, results):
        recomputed = {v: _recomputed(m, prompt, ids, temperature) for v, m in models.items()}
        for i, (lp, v) in enumerate(zip(lps, versions)):
            own.append(recomputed[v][i] - lp)
            others.append(max(abs(recomputed[w][i] - lp) for w in models if w != v))
    ratio = torch.tensor(own)
    k3 = float((ratio.exp() - 1 - ratio).mean())
    return k3, float(ratio.abs().max()), others


def test_a_version_taking_over_between_decode_steps_samples_every_token_after_it(warm, capsys):
    model, tokenizer = warm
    models = {1: model, 2: _perturbed(model, 5)}
    prompts = [render_prompt(tokenizer, t, [{"role": "user", "content": t}]) for t in PROMPTS]
    asked = []

    def newer(version):  # version 2 published after the 8th token
        asked.append(version)
        return (models[2], 2) if len(asked) == 8 and version < 2 else None

    results = sample(
        models[1],
        prompts,
        list(range(len(prompts))),
        temperature=1.0,
        max_new_tokens=24,
        eos_id=-1,  # no row ends early: every row crosses the seam
        pad_id=tokenizer.pad_token_id,
        version=1,
        newer=newer,
    )
    for ids, lps, versions in results:
        assert len(ids) == len(lps) == 24 and versions == [1] * 8 + [2] * 16
    k3, worst, others = _segments_match_their_versions(models, prompts, results)
    with capsys.disabled():
        print(f"\nembedded, a version taking over at token 8: k3 {k3:.2e}, max |dlogprob| {worst:.2e}")
    assert k3 < 1e-3 and worst < 1e-3
    assert sum(d > 1e-2 for d in others) > len(others) // 2  # the versions are told apart by their logprobs


def test_the_sampler_in_interrupt_mode_reports_each_tokens_version(tmp_path, warm):
    from orchestrator import rundir
    from orchestrator.hf.sampler import Sampler

    model, tokenizer = warm
    versions = {1: model, 2: _perturbed(model, 5)}
    for v, m in versions.items():
        wdir = rundir.weights_dir(tmp_path, v)
        m.save_pretrained(wdir)
        tokenizer.save_pretrained(wdir)
        rundir.mark_stable(wdir)
    sampler = Sampler(tmp_path, eos_id=-1, pad_id=tokenizer.pad_token_id, interrupt=True)
    sampler.reload(rundir.weights_dir(tmp_path, 1), 1)
    asked = sampler._newer
    calls = []

    def publish_during_the_batch(version):  # the trainer publishes version 2 after the 5th token
        calls.append(version)
        if len(calls) == 5:
            sampler.reload(rundir.weights_dir(tmp_path, 2), 2)
        return asked(version)

    sampler._newer = publish_during_the_batch
    prompt = render_prompt(tokenizer, "abc", [{"role": "user", "content": "abc"}])
    completion = sampler.sample_coalesced(prompt, temperature=1.0, max_new_tokens=16, seed=3)
    assert (completion.version, completion.newest_version, completion.token_versions) == (1, 2, ((1, 5), (2, 11)))
    per_token = [1] * 5 + [2] * 11
    k3, worst, _ = _segments_match_their_versions(
        versions, [prompt], [(completion.token_ids, completion.logprobs, per_token)]
    )
    assert k3 < 1e-3 and worst < 1e-3
