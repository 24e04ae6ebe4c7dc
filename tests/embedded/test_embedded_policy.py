import threading

import pytest
import torch

from orchestrator import rundir as files
from orchestrator.serve.policy import (
    EmbeddedSampler,
    PolicyConfig,
    batch_sequence_logprobs,
    build_policy,
    load_policy,
    sample_group,
    save_weights,
    sequence_logprobs,
)
from orchestrator.serve.tokenizer import EOS

TINY_POLICY = PolicyConfig(d_model=16, layers=1, heads=2, d_ff=16)


def _k3_kl(sampler_lp, trainer_lp):
    # KL(sampler || trainer) estimated on tokens drawn from the sampler (k3 estimator, >= 0)
    tot, n = 0.0, 0
    for a, b in zip(sampler_lp, trainer_lp):
        for x, y in zip(a, b):
            r = torch.exp(torch.tensor(y - x))
            tot += float(r - 1 - torch.log(r))
            n += 1
    return tot / n


@pytest.mark.parametrize("arch", ["transformer", "gru"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampler_and_trainer_logprobs_agree(arch, temperature):
    model = build_policy(PolicyConfig(arch=arch, d_model=32, layers=2, heads=4, d_ff=32), seed=1)
    with torch.no_grad():
        model.head.weight.mul_(8.0)  # make the distribution peaked, not uniform
    comps = []
    for i, prompt in enumerate(["abc", "hgfedc", "aaaa"]):
        comps += sample_group(model, prompt, 8, temperature=temperature, max_new_tokens=40, seed=i)
    rec = batch_sequence_logprobs(model, [c.token_ids for c in comps], [len(c.prompt_ids) for c in comps], temperature)
    assert [len(r) for r in rec] == [len(c.completion_ids) for c in comps]
    kl = _k3_kl([c.logprobs for c in comps], rec)
    assert kl < 1e-3
    assert max(abs(x - y) for c, r in zip(comps, rec) for x, y in zip(c.logprobs, r)) < 1e-4
    one = sequence_logprobs(model, comps[0].token_ids, len(comps[0].prompt_ids), temperature)
    assert one == pytest.approx(comps[0].logprobs, abs=1e-4)


def test_agreement_check_detects_a_temperature_mismatch():
    """The agreement test above can fail: recomputing at the wrong temperature is caught."""
    model = build_policy(PolicyConfig(d_model=32, heads=4), seed=3)
    with torch.no_grad():
        model.head.weight.mul_(20.0)  # peak the distribution so the temperature matters
    comps = sample_group(model, "abcd", 8, temperature=1.0, max_new_tokens=20, seed=0)
    ids, plens = [c.token_ids for c in comps], [len(c.prompt_ids) for c in comps]
    assert _k3_kl([c.logprobs for c in comps], batch_sequence_logprobs(model, ids, plens, 1.0)) < 1e-6
    assert _k3_kl([c.logprobs for c in comps], batch_sequence_logprobs(model, ids, plens, 0.5)) > 1e-3


def test_sampling_is_deterministic_given_seed_and_well_formed():
    model = build_policy(TINY_POLICY, seed=0)
    a = sample_group(model, "abcde", 8, temperature=1.0, max_new_tokens=15, seed=42)
    b = sample_group(model, "abcde", 8, temperature=1.0, max_new_tokens=15, seed=42)
    c = sample_group(model, "abcde", 8, temperature=1.0, max_new_tokens=15, seed=43)
    assert a == b
    assert [x.completion_ids for x in a] != [x.completion_ids for x in c]
    for x in a:
        assert 1 <= len(x.completion_ids) <= 15
        assert len(x.logprobs) == len(x.completion_ids)
        assert all(lp <= 0.0 for lp in x.logprobs)
        assert EOS not in x.completion_ids[:-1]  # EOS can only be the last token
        assert x.finished == (x.completion_ids[-1] == EOS)
        assert len(x.token_ids) == len(x.mask) == len(x.full_logprobs)
        assert x.mask == [0] * len(x.prompt_ids) + [1] * len(x.completion_ids)


def test_sample_group_rejects_bad_arguments():
    model = build_policy(TINY_POLICY, seed=0)
    with pytest.raises(ValueError, match="temperature"):
        sample_group(model, "ab", 2, temperature=0.0, max_new_tokens=4, seed=0)
    with pytest.raises(ValueError, match="n must"):
        sample_group(model, "ab", 0, temperature=1.0, max_new_tokens=4, seed=0)


def test_save_and_load_roundtrip(tmp_path):
    model = build_policy(TINY_POLICY, seed=5)
    dest = tmp_path / "weights" / "step_0"
    save_weights(model, dest)
    assert sorted(p.name for p in dest.iterdir()) == [files.MODEL_FILE, files.POLICY_FILE]
    assert [p.name for p in dest.parent.iterdir()] == ["step_0"]  # no temp dir left behind
    loaded = load_policy(dest)
    ids = torch.tensor([[1, 5, 6, 7, 3, 8, 9]])
    assert torch.equal(model(ids)[0], loaded(ids)[0])
    with pytest.raises(FileExistsError):
        save_weights(model, dest)


def _publish(model, wdir):
    save_weights(model, wdir)
    files.mark_stable(wdir)


def test_sampler_reload_requires_stable_and_ignores_older_versions(tmp_path):
    m0, m1 = build_policy(TINY_POLICY, seed=0), build_policy(TINY_POLICY, seed=1)
    save_weights(m0, tmp_path / "step_0")
    with pytest.raises(FileNotFoundError, match="STABLE"):
        EmbeddedSampler.from_weights(tmp_path / "step_0", 0)
    files.mark_stable(tmp_path / "step_0")
    _publish(m1, tmp_path / "step_1")
    s = EmbeddedSampler.from_weights(tmp_path / "step_1", 1)
    s.reload(tmp_path / "step_0", 0)  # a late, older reload must not roll back
    assert s.version == 1
    out = s.sample_group("abc", 2, temperature=1.0, max_new_tokens=5, seed=0)
    assert {c.policy_version for c in out} == {1}
    with pytest.raises(RuntimeError, match="no policy"):
        EmbeddedSampler().sample_group("abc", 1, temperature=1.0, max_new_tokens=2, seed=0)


def test_sampler_is_safe_to_use_while_reloading(tmp_path):
    """Worker threads sample while the main thread reloads: every completion must come entirely
    from the version it reports (its logprobs recomputed on that version match)."""
    models = [build_policy(TINY_POLICY, seed=v) for v in range(4)]
    for v, m in enumerate(models):
        _publish(m, tmp_path / f"step_{v}")
    sampler = EmbeddedSampler.from_weights(tmp_path / "step_0", 0)
    results, errors = [], []

    def worker(k):
        try:
            for i in range(15):
                results.extend(sampler.sample_group("abcd", 2, temperature=1.0, max_new_tokens=6, seed=k * 100 + i))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for v in range(1, 4):
        sampler.reload(tmp_path / f"step_{v}", v)
    for t in threads:
        t.join()
    assert not errors
    assert sampler.version == 3
    for c in results:
        rec = sequence_logprobs(models[c.policy_version], c.token_ids, len(c.prompt_ids), 1.0)
        assert rec == pytest.approx(c.logprobs, abs=1e-5)


def test_batched_groups_match_single_group_sampling():
    from orchestrator.serve.policy import sample_groups

    model = build_policy(PolicyConfig(d_model=32, heads=4), seed=2)
    prompts = ["abc", "hgfedc", "bad", "aaaa", "hh"]
    batched = sample_groups(model, prompts, 4, temperature=1.0, max_new_tokens=12, seeds=[7, 8, 9, 10, 11])
    single = [
        sample_group(model, p, 4, temperature=1.0, max_new_tokens=12, seed=s)
        for p, s in zip(prompts, [7, 8, 9, 10, 11])
    ]
    assert [[c.completion_ids for c in g] for g in batched] == [[c.completion_ids for c in g] for g in single]
    for gb, gs in zip(batched, single):
        for cb, cs in zip(gb, gs):
            assert cb.logprobs == pytest.approx(cs.logprobs, abs=1e-5)
    with pytest.raises(ValueError, match="seeds"):
        sample_groups(model, prompts, 4, temperature=1.0, max_new_tokens=12, seeds=[1])


def test_sequences_outside_the_position_table_are_a_clear_error():
    model = build_policy(PolicyConfig(d_model=16, heads=2, layers=1, max_prompt=6, max_len=12), seed=0)
    with pytest.raises(ValueError, match="position table"):
        sample_group(model, "abcdefgh", 1, temperature=1.0, max_new_tokens=2, seed=0)  # prompt too long
    with pytest.raises(ValueError, match="position table"):
        sample_group(model, "ab", 1, temperature=1.0, max_new_tokens=20, seed=0)  # completion too long
