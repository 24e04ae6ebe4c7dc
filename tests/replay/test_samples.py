"""`orch replay` on logs of several-sample episodes (docs/rules.md, "Samples"): `--check`,
`--reexecute`, `--diff` and `--episode` read the samples, their agents and weights."""

from __future__ import annotations

import msgspec
import orjson
import pytest

from orchestrator.core import events as ev
from orchestrator.core.arrays import Tokens
from replay.check import check_log
from replay.diff import diff_logs
from replay.logs import write_events
from replay.reexec import ReexecOptions, reexecute
from replay.source import open_run
from tests.support.logs import rows, sim_log
from tests.support.params import sim_params
from tests.support.sim import SimOptions, SimWorld

SAMPLES = SimOptions(max_samples=4, agent_rewards=True)


def samples_log(path, seed=0, options=SAMPLES, **params):
    return sim_log(path, sim_params(seed, batch_cut="groups", max_off_policy_steps=1, **params), seed, options)


def several(path) -> list[dict]:
    return [data for _, kind, data in rows(path) if kind == "episode_completed" and data.get("samples")]


@pytest.mark.parametrize("background", [False, True])
def test_a_several_sample_run_checks_deterministic(tmp_path, background):
    options = SimOptions(max_samples=4, agent_rewards=not background, settle="random" if background else "immediate")
    path = samples_log(tmp_path / "a.db", 3, options, finalize_in_background=background)
    assert several(path)
    with open_run(path) as log:
        result = check_log(log)
    assert result.deterministic, result.divergence


def test_reexecuted_through_its_own_path_it_is_the_same_log(tmp_path):
    src = samples_log(tmp_path / "a.db", 1)
    assert any(data.get("sample_advantages") for _, kind, data in rows(src) if kind == "group_finalized")
    with open_run(src) as log:
        report = reexecute(log, tmp_path / "re", ReexecOptions("inline", "recorded"))
    assert report.halted is None
    with open_run(src) as a, open_run(report.out) as b:
        assert diff_logs(a, b, "events").equivalent


def test_diff_names_the_first_batch_another_sample_weight_changes(tmp_path, cli):
    a = samples_log(tmp_path / "a.db", 2)
    b = samples_log(tmp_path / "b.db", 2, sample_weight="sample")
    code, out = cli.json("--diff", a, b, "--level", "batches")
    assert code == 1
    first_a = next(data for _, kind, data in rows(a) if kind == "batch_shipped")
    assert out["divergence"]["a"]["data"]["step"] == 1 and out["divergence"]["a"]["data"] == first_a
    differing = {f["path"] for f in out["divergence"]["fields"]}
    assert differing == {"sha256"}  # the same samples, in the same order, weighed otherwise
    code, out = cli.json("--diff", a, samples_log(tmp_path / "c.db", 2), "--level", "events")
    assert code == 0 and out["equivalent"]


def test_diff_names_a_sample_array_that_differs(tmp_path, cli):
    """Token arrays are compared too (the row's payload), not only the event's JSON."""
    world = SimWorld(sim_params(4, batch_cut="groups"), seed=4, options=SAMPLES)
    world.run()
    write_events(tmp_path / "a.db", world.log)
    index, episode = next((i, e) for i, e in enumerate(world.log) if e.kind == "episode_completed" and e.samples)
    logprobs = episode.logprobs[:]
    logprobs[-1] -= 0.5  # the last sample's last token
    tokens = Tokens.of(episode.token_ids, episode.mask, logprobs)
    changed = world.log[:index] + [msgspec.structs.replace(episode, tokens=tokens)] + world.log[index + 1 :]
    write_events(tmp_path / "b.db", changed)
    code, out = cli.json("--diff", tmp_path / "a.db", tmp_path / "b.db", "--level", "events")
    assert code == 1 and out["divergence"]["a"]["seq"] == index + 1
    assert [f["path"] for f in out["divergence"]["fields"]] == [f"logprobs[{len(logprobs) - 1}]"]


def test_episode_lists_its_samples_and_a_sample_id_finds_its_episode(tmp_path, cli):
    path = samples_log(tmp_path / "a.db", 5)
    episode = several(path)[0]
    second = ev.sample_id(episode["episode_id"], 1)
    for asked in (episode["episode_id"], second):
        result = cli(path, "--episode", asked)
        assert result.exit_code == 0, result.output
        (line,) = [orjson.loads(x) for x in result.stdout.splitlines()]
        assert line["episode_id"] == episode["episode_id"]
        listed = line["training_samples"]
        assert [s["sample_id"] for s in listed] == [ev.sample_id(episode["episode_id"], k) for k in range(len(listed))]
        assert [len(s["token_ids"]) for s in listed] == [n for n, _ in line["samples"]]
        assert sum((s["token_ids"] for s in listed), []) == line["token_ids"]
        assert [s["agent"] for s in listed] == line["agents"]
        rewards = dict(line["agent_rewards"])
        assert [s["reward"] for s in listed] == [rewards[agent] for agent in line["agents"]]
