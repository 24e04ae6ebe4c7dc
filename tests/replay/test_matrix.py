"""The equivalence matrix of the finalize paths, through real logs and `orch replay --diff`.

12 seeds x {trace, token batching} x {constant_trainer_batch_size on/off} x
max_off_policy_steps in {1, 2, 8}, with the dispatch capacity on: GRPO inline and GRPO opted into
background finalization with each group settled before the next input ship bit-identical
batches. The opted-in run is built twice: by a SimWorld of its own (settle="immediate") and by
re-executing the inline run's inputs (`--reexecute --finalize background --settle-order immediate`)
for the first seeds (the re-execution's own matrix is in test_reexec.py), to keep the whole matrix
well under a minute.
"""

from __future__ import annotations

import itertools

import pytest

from replay.diff import diff_logs
from replay.reexec import ReexecOptions, reexecute
from replay.source import open_run
from tests.support.logs import rows, sim_log
from tests.support.params import sim_params
from tests.support.sim import SimOptions

SEEDS = range(12)
BATCHING = {"trace": {}, "token": {"token_batch_size": 120}}
MATRIX = list(itertools.product(SEEDS, BATCHING, (False, True), (1, 2, 8)))
DEEP_SEEDS = (0, 1, 2)  # also re-executed and compared at every level


def _params(seed, batching, constant, max_off, **kw):
    # With the dispatch capacity on, as `orch run` has it by default.
    return sim_params(
        seed,
        constant_trainer_batch_size=constant,
        max_off_policy_steps=max_off,
        capacity="staleness",
        **BATCHING[batching],
        **kw,
    )


@pytest.mark.parametrize(
    "seed,batching,constant,max_off",
    MATRIX,
    ids=[f"s{s}-{b}-{'const' if c else 'var'}-off{m}" for s, b, c, m in MATRIX],
)
def test_inline_and_opted_in_immediate_settle_ship_identical_batches(tmp_path, seed, batching, constant, max_off):
    inline = sim_log(tmp_path / "inline.db", _params(seed, batching, constant, max_off), seed)
    opted = sim_log(
        tmp_path / "opted.db",
        _params(seed, batching, constant, max_off, finalize_in_background=True),
        seed,
        SimOptions(settle="immediate"),
    )
    with open_run(inline) as a, open_run(opted) as b:
        result = diff_logs(a, b, "batches")
        assert result.equivalent, result.divergence
        assert result.compared == 10, "every step shipped in both"
        # The logs really took different paths: background finalize_started, background_finalized inputs.
        assert not diff_logs(a, b, "events").equivalent
        if seed not in DEEP_SEEDS:
            return
        assert diff_logs(a, b, "accounting").equivalent
        assert diff_logs(a, b, "curriculum").equivalent
        report = reexecute(a, tmp_path / "reexec", ReexecOptions("background", "immediate"))
        assert report.halted is None and report.stop_reason == "completed"
        assert report.results_computed == 0 and report.results_reused > 0, "inline results reused, nothing re-scored"
        with open_run(report.out) as c:
            assert diff_logs(a, c, "batches").equivalent
            assert diff_logs(b, c, "events").equivalent, "re-execution == the opted-in run, event for event"
    if max_off < 8:  # the capacity closed the gate (with 8 steps of slack it never binds here)
        assert any(kind == "gate_changed" and data["reason"] == "capacity" for _, kind, data in rows(inline))
    started = [data for _, kind, data in rows(opted) if kind == "finalize_started"]
    assert started and all(data["background"] for data in started)


@pytest.mark.parametrize("seed", range(4))
def test_std_normalized_grpo_ships_identical_batches_inline_and_in_the_background(tmp_path, seed):
    """algorithm.grpo.std_normalization: the core scores inline and the background path (the
    sim's results, a re-execution) with the same rule; the option really changes the advantages
    (and the run_started), and off it logs no field at all."""
    params = _params(seed, "trace", False, 2, std_normalization=True)
    inline = sim_log(tmp_path / "inline.db", params, seed)
    opted = sim_log(
        tmp_path / "opted.db",
        _params(seed, "trace", False, 2, std_normalization=True, finalize_in_background=True),
        seed,
        SimOptions(settle="immediate"),
    )
    plain = sim_log(tmp_path / "plain.db", _params(seed, "trace", False, 2), seed)
    with open_run(inline) as a, open_run(opted) as b, open_run(plain) as c:
        result = diff_logs(a, b, "batches")
        assert result.equivalent, result.divergence
        assert result.compared == 10
        assert not diff_logs(a, c, "batches").equivalent, "std normalization changed the advantages"
        report = reexecute(a, tmp_path / "reexec", ReexecOptions("background", "immediate"))
        assert report.halted is None and report.stop_reason == "completed"
        with open_run(report.out) as d:
            assert diff_logs(b, d, "events").equivalent, "re-execution == the opted-in run, event for event"
    started = {kind: data for _, kind, data in rows(inline) if kind == "run_started"}["run_started"]
    assert started["params"]["std_normalization"] is True
    assert not {d["params"]["std_normalization"] for _, kind, d in rows(plain) if kind == "run_started"} - {False}
    for _, kind, data in rows(inline):
        if kind == "group_finalized" and any(data["advantages"]):
            advantages = data["advantages"]
            variance = sum(x * x for x in advantages) / len(advantages)
            assert abs(variance - 1.0) < 1e-4  # unit std (up to the epsilon)


def test_a_reexecution_rescores_std_normalized_groups_with_the_same_rule(tmp_path):
    src = sim_log(tmp_path / "inline.db", sim_params(2, max_off_policy_steps=1, std_normalization=True), 2)
    with open_run(src) as run:
        report = reexecute(run, tmp_path / "shuffled", ReexecOptions("background", "shuffled", 7))
    assert report.halted is None and report.results_computed > 0  # groups with changed survivors
    scored = [d["advantages"] for _, kind, d in rows(report.out) if kind == "background_finalized"]
    assert len(scored) > report.results_computed
    for advantages in scored:
        if any(advantages):
            assert abs(sum(x * x for x in advantages) / len(advantages) - 1.0) < 1e-4


def test_grpo_advantages_with_and_without_the_std_against_hand_computed_values():
    from orchestrator.core.advantages import grpo_advantages

    # rewards 1, 0, 0, 1: mean 0.5, population std 0.5
    assert grpo_advantages([1.0, 0.0, 0.0, 1.0]) == [0.5, -0.5, -0.5, 0.5]
    normalized = grpo_advantages([1.0, 0.0, 0.0, 1.0], std_normalization=True)
    assert normalized == pytest.approx([0.5 / 0.500001, -0.5 / 0.500001, -0.5 / 0.500001, 0.5 / 0.500001], rel=1e-12)
    assert grpo_advantages([0.3, 0.3], std_normalization=True) == [0.0, 0.0]  # equal rewards: no signal
    assert grpo_advantages([0.7], std_normalization=True) == [0.0]


def test_the_std_option_reaches_the_core_params_from_the_config():
    from orchestrator.config import RunConfig

    assert RunConfig.model_validate({}).core_params().std_normalization is False
    on = RunConfig.model_validate({"algorithm": {"grpo": {"std_normalization": True}}})
    assert on.core_params().std_normalization is True
