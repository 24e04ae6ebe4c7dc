"""Several training samples per episode (docs/rules.md, "Samples"): simulated runs with a random
number of samples per episode, each sample sampled by its own version."""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest

from orchestrator.core import events as ev
from orchestrator.core.arrays import Tokens
from orchestrator.core.batch import decode_batch
from orchestrator.core.decide import decide
from orchestrator.core.evolve import evolve_from, fold
from orchestrator.core.state import conservation, initial_state, min_fresh_version, state_hash
from tests.core.encoded import fold_encoded
from tests.support.sim import SimOptions, SimWorld

CUTS = ("prefix", "groups")
WEIGHTS = ("episode", "sample")
MATRIX = list(itertools.product(range(4), CUTS, WEIGHTS, (False, True), (None, 60)))


def params(seed: int, cut: str, weight: str, background: bool, token_batch_size: int | None) -> ev.CoreParams:
    return ev.CoreParams(
        seed=seed,
        env_ratios={"a": 1.0, "b": 1.0},
        group_size=4,
        batch_size=12,
        token_batch_size=token_batch_size,
        max_inflight=16,
        max_steps=12,
        max_off_policy_steps=1,
        zero_output_batches=1000,
        finalize_in_background=background,
        batch_cut=cut,
        sample_weight=weight,
    )


def simulate(seed, cut, weight, background, token_batch_size, agents=False):
    p = params(seed, cut, weight, background, token_batch_size)
    options = SimOptions(max_samples=4, agent_rewards=agents, settle="random" if background else "immediate")
    world = SimWorld(p, seed=seed, options=options)
    world.start()
    checks = []  # the conservation law after every action
    while world.advance():
        checks.append(conservation(world.state))
    return world, checks


@pytest.mark.parametrize("seed,cut,weight,background,tokens", MATRIX)
def test_every_sample_is_shipped_dropped_or_pending_once(seed, cut, weight, background, tokens):
    world, checks = simulate(seed, cut, weight, background, tokens)
    assert all(holds for holds, _ in checks), next(terms for holds, terms in checks if not holds)
    log = world.log
    completed = {e.episode_id: e for e in log if e.kind == "episode_completed"}
    assert any(len(e.samples) > 1 for e in completed.values()), "the run has several-sample episodes"
    shipped = [t for e in log if e.kind == "batch_shipped" for t in e.sample_ids]
    assert len(shipped) == len(set(shipped)), "a sample shipped twice"
    assert sum(e.kind == "batch_shipped" for e in log) == 12
    # Each sample id names a sample of a completed episode.
    for trace_id in shipped:
        episode = completed[ev.episode_of(trace_id)]
        assert trace_id // ev.SAMPLE_ID_STRIDE < max(1, len(episode.samples))


def test_staleness_judges_each_sample_by_its_own_oldest_token():
    world, _ = simulate(1, "groups", "episode", False, None)
    state, partly = None, 0
    for event in world.log:
        if event.kind == "batch_shipped":
            oldest = min_fresh_version(state.params, event.step)
            assert all(state.traces[t].policy_start >= oldest for t in event.sample_ids)
        if event.kind == "group_settled":
            stale = {ev.episode_of(t) for t in event.dropped.get("stale", [])}
            partly += len(stale & {ev.episode_of(t) for t in event.sample_ids})
        state = evolve_from(state, event)
    assert partly, "an episode with a stale sample and a fresh one shipped the fresh one"


@pytest.mark.parametrize("tokens", [None, 60])
def test_a_groups_samples_never_split_across_batches(tokens):
    for seed in range(4):
        world, _ = simulate(seed, "groups", "episode", True, tokens)
        group_of = {}
        for e in world.log:
            if e.kind == "group_settled":
                group_of.update(dict.fromkeys(e.sample_ids, e.group_id))
        batches_of_group: dict[int, set[int]] = {}
        for e in world.log:
            if e.kind == "batch_shipped":
                for t in e.sample_ids + e.pruned_ids:
                    batches_of_group.setdefault(group_of[t], set()).add(e.step)
        assert batches_of_group and all(len(steps) == 1 for steps in batches_of_group.values())


def test_the_prefix_cut_splits_groups_where_the_batch_ends():
    """The cut a log without `batch_cut` was recorded with: a batch of exactly batch_size."""
    world, _ = simulate(0, "prefix", "episode", False, None)
    sizes = [len(e.sample_ids) + len(e.pruned_ids) for e in world.log if e.kind == "batch_shipped"]
    assert sizes == [12] * 12


@pytest.mark.parametrize("weight", WEIGHTS)
def test_the_batch_file_weighs_each_sample(weight):
    world, _ = simulate(2, "groups", weight, False, None)
    completed = {e.episode_id: e for e in world.log if e.kind == "episode_completed"}
    state, payloads = initial_state(world.params), {}
    for event in (e for e in world.log if e.kind in ev.INPUT_KINDS):  # decided again, for the batch files
        decide(state, event, payloads)
    weights: Counter[int] = Counter()
    for payload in payloads.values():
        batch = decode_batch(payload)
        for episode, w in zip(batch.episode_id, batch.sample_weight):
            samples = max(1, len(completed[int(episode)].samples))
            assert w == (1.0 / samples if weight == "episode" else 1.0)
            weights[samples] += 1
    assert weights[1] and sum(n for k, n in weights.items() if k > 1)


@pytest.mark.parametrize("weight", WEIGHTS)
def test_a_resume_rebuilds_the_batch_files_it_shipped_weights_included(weight):
    """What a resume rewrites from the state (`Orchestrator.batch_payload`) is byte for byte the
    batch file `decide` hashed: the sample weights come back with their samples."""
    from orchestrator.core.batch import batch_sha256
    from orchestrator.shell.loop import Orchestrator

    world, _ = simulate(1, "groups", weight, False, None)
    state, payloads, rebuilt = initial_state(world.params), {}, 0
    for event in (e for e in world.log if e.kind in ev.INPUT_KINDS):
        for decision in decide(state, event, payloads):
            if decision.kind == "batch_shipped":
                payload = Orchestrator.batch_payload(decision.step, state.shipped_batches[decision.step])
                assert payload == payloads[decision.step] and batch_sha256(payload) == decision.sha256
                rebuilt += 1
    assert rebuilt == 12


def test_a_fold_of_the_rows_is_the_live_state_at_every_point():
    world, _ = simulate(3, "groups", "episode", True, None, agents=True)
    log = world.log
    for cut in (0.2, 0.45, 0.7, 1.0):
        events = log[: int(len(log) * cut)]
        state, _ = fold_encoded(None, events)
        assert state_hash(state) == state_hash(fold(events))
    assert state_hash(fold_encoded(None, log)[0]) == state_hash(world.state)


def test_agents_scored_apart_take_their_agents_advantage():
    world, _ = simulate(0, "groups", "episode", False, None, agents=True)
    finalized = [e for e in world.log if e.kind == "group_finalized" and e.sample_advantages]
    assert finalized
    completed = {e.episode_id: e for e in world.log if e.kind == "episode_completed"}
    for e in finalized:
        for agent in "ab":
            rewards = {
                t: dict(completed[t].agent_rewards)[agent]
                for t in e.episode_ids
                if agent in dict(completed[t].agent_rewards)
            }
            mean = sum(rewards.values()) / len(rewards)
            for trace_id, advantage in e.sample_advantages:
                episode = completed[ev.episode_of(trace_id)]
                index = trace_id // ev.SAMPLE_ID_STRIDE
                if episode.agents[index] == agent:
                    assert advantage == pytest.approx(rewards[episode.episode_id] - mean)


def test_the_traces_one_seat_played_in_an_episode_are_scored_in_one_pool():
    """best-of-n: `x#1` and `x#2` are seat `x`'s attempts; each takes its reward minus the mean of
    every attempt of the seat across the group, whatever order named them."""
    from tests.support.params import Driver

    driver = Driver(group_size=2, batch_size=64, max_inflight=2)
    driver.start()
    rewards = {0: {"x#1": 1.0, "x#2": 0.0, "y": 0.5}, 1: {"x#1": 0.0, "x#2": 0.0, "y": 1.0}}
    out = []
    for index, episode_id in enumerate(sorted(driver.state.inflight)):
        agents = rewards[index]
        out += driver.feed(
            ev.EpisodeCompleted(
                episode_id=episode_id,
                group_id=driver.state.inflight[episode_id],
                ok=True,
                temperature=1.0,
                reward=sum(agents.values()) / 3,
                tokens=Tokens.of([7, 7] * 3, [0, 1] * 3, [0.0, -1.0] * 3),
                policy_start=0,
                policy_end=0,
                samples=((2, 1),) * 3,
                agents=tuple(agents),
                agent_rewards=tuple(agents.items()),
            )
        )
    (finalized,) = [e for e in out if e.kind == "group_finalized"]
    expected = {}
    for episode_id, agents in zip(finalized.episode_ids, rewards.values()):  # in the order they completed
        for k, (agent, reward) in enumerate(agents.items()):
            mean = 0.25 if agent.startswith("x") else 0.75  # x: (1 + 0 + 0 + 0) / 4; y: (0.5 + 1) / 2
            expected[ev.sample_id(episode_id, k)] = reward - mean
    assert dict(finalized.sample_advantages) == pytest.approx(expected)


def test_one_sample_episodes_write_no_sample_fields():
    one = ev.EpisodeCompleted(
        episode_id=3,
        group_id=1,
        ok=True,
        reward=0.0,
        temperature=1.0,
        tokens=Tokens.of([1, 2], [0, 1], [0, -1.0]),
        policy_start=0,
        policy_end=0,
    )
    kind, data, _ = ev.encode_event(one)
    assert b"samples" not in data and b"agents" not in data
    finalized = ev.GroupFinalized(group_id=1, episode_ids=[3], advantages=[0.5])
    assert b"sample_advantages" not in ev.encode_event(finalized)[1]


@pytest.mark.parametrize(
    "fields,error",
    [
        ({"samples": ((2, 1),)}, "two or more samples"),
        ({"samples": ((2, 1), (1, 1))}, "count 3 tokens where the episode has 4"),
        ({"samples": ((3, 2), (1, 1))}, "do not match the mask"),
        ({"samples": ((2, 1), (2, 1)), "agents": ("a",)}, "agents names 1 samples where the episode has 2"),
        ({"samples": ((2, 1), (2, 1)), "agents": ("a", "b"), "agent_rewards": (("a", 1.0),)}, "agent_rewards scores"),
    ],
)
def test_samples_that_do_not_fit_the_arrays_are_refused(fields, error):
    with pytest.raises(ValueError, match=error):
        ev.EpisodeCompleted(
            episode_id=1,
            group_id=1,
            ok=True,
            reward=0.0,
            temperature=1.0,
            tokens=Tokens.of([1, 2, 3, 4], [0, 1, 0, 1], [0, -1.0, 0, -1.0]),
            policy_start=0,
            policy_end=0,
            **fields,
        )


def test_an_episode_splits_into_its_samples_with_their_own_versions():
    from orchestrator.core.samples import split_episode

    episode = ev.EpisodeCompleted(
        episode_id=7,
        group_id=2,
        ok=True,
        temperature=1.0,
        reward=0.5,
        tokens=Tokens.of([1, 2, 3, 4, 5], [0, 1, 1, 0, 1], [0, -1.0, -2.0, 0, -3.0]),
        policy_start=3,
        policy_end=4,
        token_versions=((3, 1), (4, 2)),
        samples=((3, 2), (2, 1)),
    )
    first, second = split_episode(episode)
    assert (first.sample_id, second.sample_id) == (7, 7 + ev.SAMPLE_ID_STRIDE)
    assert first.episode_id == second.episode_id == 7
    assert list(first.token_ids) == [1, 2, 3] and list(second.token_ids) == [4, 5]
    assert (first.policy_start, first.policy_end, first.token_versions) == (3, 4, ((3, 1), (4, 1)))
    assert (second.policy_start, second.policy_end, second.token_versions) == (4, 4, ())
    assert np.allclose(list(second.logprobs), [0, -3.0])


def test_new_runs_cut_by_groups_and_a_resume_may_not_change_the_cut():
    from orchestrator.config import load_config, meaning_changes

    config = load_config(None, [])
    assert config.batch.cut == "groups" and config.core_params().batch_cut == "groups"
    assert load_config(None, ["batch.constant_trainer_batch_size=true"]).batch.cut == "prefix"
    old = load_config(None, ["batch.cut=prefix"])
    assert old.batch.cut == "prefix" and old.core_params().batch_cut == "prefix"
    resumed = load_config(None, ["batch.cut=groups"], base=old.model_dump(mode="json"))
    assert meaning_changes(old, resumed) == ["batch.cut"]
