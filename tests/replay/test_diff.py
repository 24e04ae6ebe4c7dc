"""`orch replay --diff`: levels, first divergence reported precisely, masking, streaming."""

from __future__ import annotations

import tracemalloc

import orjson
import pytest

from eventlog import EventLog
from orchestrator.core import events as ev
from orchestrator.orch_log import LOG_MAGIC_META
from replay.diff import MAX_FIELD_DIFFS, diff_logs, normalize, structural_diff
from replay.logs import write_events
from replay.reexec import ReexecOptions, reexecute
from replay.source import open_run
from tests.support.logs import rows, sim_log, sim_run
from tests.support.params import sim_params
from tests.support.sim import SimOptions


def reference_first(a_rows, b_rows, kinds=None, key=lambda d: d):
    """Brute force: index and both rows of the first differing item (None past the end)."""
    a = [r for r in a_rows if kinds is None or r[1] in kinds]
    b = [r for r in b_rows if kinds is None or r[1] in kinds]
    for i in range(max(len(a), len(b))):
        x, y = (a[i] if i < len(a) else None), (b[i] if i < len(b) else None)
        if x is None or y is None or x[1] != y[1] or key(x[2]) != key(y[2]):
            return i, x, y
    return None


def reference_accounting_first(a_rows, b_rows):
    def items(rs, kinds, explode):
        return [(seq, item) for seq, kind, data in rs if kind in kinds for item in explode(kind, data)]

    seqs = {
        "admitted": (("group_settled",), lambda k, d: d["sample_ids"]),
        "cancelled": (
            ("episode_cancelled", "group_cancelled"),
            lambda k, d: [
                ["episode", d["episode_id"], d["reason"]]
                if k == "episode_cancelled"
                else ["group", d["group_id"], d["reason"], d["count"]]
            ],
        ),
        "sampled": (("batch_shipped",), lambda k, d: d["sample_ids"]),
    }
    firsts = []
    for name, (kinds, explode) in seqs.items():
        a, b = items(a_rows, kinds, explode), items(b_rows, kinds, explode)
        for i in range(max(len(a), len(b))):
            x, y = (a[i] if i < len(a) else None), (b[i] if i < len(b) else None)
            if x is None or y is None or x[1] != y[1]:
                firsts.append((x[0] if x else float("inf"), y[0] if y else float("inf"), f"{name}[{i}]"))
                break
    return min(firsts) if firsts else None


def _seqs(div):
    return (div.a.seq if div.a else None, div.b.seq if div.b else None)


# --- the random-delay run: totals equal, membership differs, stale cancels occur ------


@pytest.mark.parametrize("seed", range(4))
def test_shuffled_settle_keeps_totals_changes_membership_and_the_first_divergence_is_exact(tmp_path, seed):
    params = sim_params(seed, max_off_policy_steps=0, max_steps=12)
    inline = sim_log(tmp_path / "inline.db", params, seed)
    with open_run(inline) as a:
        report = reexecute(a, tmp_path / "delayed", ReexecOptions("background", "shuffled", seed=seed))
        assert report.halted is None and report.stop_reason == "completed"
        with open_run(report.out) as b:
            batches = diff_logs(a, b, "batches")
            accounting = diff_logs(a, b, "accounting")
            curriculum = diff_logs(a, b, "curriculum")
    totals = accounting.details["totals"]
    ta, tb = totals["a"]["acct"], totals["b"]["acct"]
    for name in ("dispatched", "completed", "failures", "cancelled_attempts", "groups_dispatched"):
        assert ta[name] == tb[name], name
    assert tb["groups_cancelled"].get("stale", 0) > 0, "stale cancels happen"
    assert not batches.equivalent and not accounting.equivalent
    assert not accounting.details["sequences"]["sampled"]["same_set"], "batch membership differs"
    assert curriculum.equivalent, "the same tasks are dispatched in the same order"

    a_rows, b_rows = rows(inline), rows(report.out)
    i, x, y = reference_first(a_rows, b_rows, {"batch_shipped"})
    assert batches.compared == i and _seqs(batches.divergence) == (x[0], y[0])
    assert (batches.divergence.a.data, batches.divergence.b.data) == (x[2], y[2])
    fields, _ = structural_diff(x[2], y[2], limit=1000)
    assert [f.path for f in batches.divergence.fields] == [f.path for f in fields][:MAX_FIELD_DIFFS]
    a_seq, b_seq, what = reference_accounting_first(a_rows, b_rows)
    assert _seqs(accounting.divergence) == (a_seq, b_seq) and accounting.divergence.what == what


def test_random_settle_world_diverges_and_the_first_divergence_is_exact(tmp_path):
    inline = sim_log(tmp_path / "inline.db", sim_params(3), 3)
    delayed = sim_log(
        tmp_path / "delayed.db",
        sim_params(3, finalize_in_background=True, max_off_policy_steps=0),
        3,
        SimOptions(settle="random", deliver_weight=0.05),
    )
    with open_run(inline) as a, open_run(delayed) as b:
        for level, kinds, key in [
            ("batches", {"batch_shipped"}, lambda d: d),
            ("curriculum", {"group_dispatched"}, lambda d: (d["env"], d["task_id"])),
            ("events", None, lambda d: d),
        ]:
            result = diff_logs(a, b, level)
            ref = reference_first(rows(inline), rows(delayed), kinds, key)
            if ref is None:
                assert result.equivalent, level
                continue
            i, x, y = ref
            assert not result.equivalent and result.compared == i, level
            assert _seqs(result.divergence) == (x and x[0], y and y[0]), level


# --- negative controls --------------------------------------------------------------------------


def test_different_seeds_diverge_at_the_right_place(tmp_path, cli):
    a = sim_log(tmp_path / "a.db", sim_params(0), 0)
    b = sim_log(tmp_path / "b.db", sim_params(1), 1)
    a_rows, b_rows = rows(a), rows(b)
    # events: run_started differs in params.seed, nothing else
    code, out = cli.json("--diff", a, b, "--level", "events")
    assert code == 1
    div = out["divergence"]
    assert (div["a"]["seq"], div["b"]["seq"], div["what"]) == (1, 1, "event #1")
    assert div["fields"] == [{"path": "params.seed", "a": 0, "b": 1}]
    for level, kinds, key in [
        ("batches", {"batch_shipped"}, lambda d: d),
        ("curriculum", {"group_dispatched"}, lambda d: (d["env"], d["task_id"])),
    ]:
        code, out = cli.json("--diff", a, b, "--level", level)
        i, x, y = reference_first(a_rows, b_rows, kinds, key)
        assert code == 1 and out["equivalent"] is False
        assert out["compared"] == i
        assert (out["divergence"]["a"]["seq"], out["divergence"]["b"]["seq"]) == (x[0], y[0])
        assert out["divergence"]["a"]["data"] == x[2] and out["divergence"]["b"]["data"] == y[2]


def test_same_params_other_world_seed_diverges_at_the_first_differing_completion(tmp_path):
    a = sim_log(tmp_path / "a.db", sim_params(0), 0)
    b = sim_log(tmp_path / "b.db", sim_params(0), 9)  # same core params, another outside world
    i, x, y = reference_first(rows(a), rows(b))
    assert x[1] == "episode_completed" or y[1] == "episode_completed"
    with open_run(a) as la, open_run(b) as lb:
        result = diff_logs(la, lb, "events")
    assert result.compared == i and _seqs(result.divergence) == (x[0], y[0])
    assert result.divergence.what == f"event #{i + 1}"


def test_a_run_that_is_a_prefix_of_the_other_ends_first(tmp_path):
    world = sim_run(sim_params(2), 2)
    full = tmp_path / "full.db"
    cut = tmp_path / "cut.db"
    write_events(full, world.log)
    write_events(cut, world.log[:500])
    with open_run(full) as a, open_run(cut) as b:
        result = diff_logs(a, b, "events")
        assert result.compared == 500 and result.divergence.b is None and result.divergence.a.seq == 501
        assert "run B has no event #501: it ended first" in result.divergence.note
        ships = diff_logs(b, a, "batches")
    n_cut = sum(1 for e in world.log[:500] if e.kind == "batch_shipped")
    assert ships.compared == n_cut and ships.divergence.a is None and ships.divergence.b.data["step"] == n_cut + 1


def test_identical_runs_written_at_different_times_are_equivalent_at_every_level(tmp_path, cli):
    world = sim_run(sim_params(4), 4)
    write_events(tmp_path / "a.db", world.log)
    write_events(tmp_path / "b.db", world.log)  # other timestamps
    for level in ("batches", "accounting", "curriculum", "events"):
        result = cli("--diff", tmp_path / "a.db", tmp_path / "b.db", "--level", level)
        assert result.exit_code == 0, result.output
        assert result.stdout.startswith(f"equivalent at the {level} level")


def test_masked_fields_are_not_compared(tmp_path):
    world = sim_run(sim_params(5), 5)
    resumed_a = [*world.log, ev.RunResumed(from_seq=10, max_steps=10)]
    resumed_b = [*world.log, ev.RunResumed(from_seq=99, max_steps=10)]
    write_events(tmp_path / "a.db", resumed_a)
    write_events(tmp_path / "b.db", resumed_b)
    with open_run(tmp_path / "a.db") as a, open_run(tmp_path / "b.db") as b:
        assert diff_logs(a, b, "events").equivalent
    assert normalize({"x": 1, "ts": 2.0, "n": [{"duration_s": 3, "y": 4}]}) == {"x": 1, "n": [{"y": 4}]}


def test_structural_diff():
    a = {"k": 1, "l": [1, 2, 3], "d": {"x": True, "y": "s"}, "only_a": 0}
    b = {"k": 1, "l": [1, 5], "d": {"x": 1, "y": "s"}, "only_b": 0}
    fields, more = structural_diff(a, b)
    assert [(f.path, f.a, f.b) for f in fields] == [
        ("d.x", True, 1),
        ("l[1]", 2, 5),
        ("l.length", 3, 2),
        ("only_a", 0, "<missing>"),
        ("only_b", "<missing>", 0),
    ]
    assert more == 0
    fields, more = structural_diff(list(range(40)), list(range(100, 140)))
    assert len(fields) == MAX_FIELD_DIFFS and more == 40 - MAX_FIELD_DIFFS
    assert structural_diff({"a": [1.0]}, {"a": [1.0]}) == ([], 0)


# --- streaming --------------------------------------------------------------------------------


def _synthetic_log(path, n: int) -> None:
    """n small events, appended raw (the diff never decodes identical rows)."""
    data = orjson.dumps({"episode_id": 1, "group_id": 1, "ok": True, "token_ids": list(range(24))}).decode()
    with EventLog.create(path, meta=LOG_MAGIC_META, durability="normal") as log:
        for _ in range(n):
            log.append_json("episode_completed", data)
            if log.pending >= 8192:
                log.commit()


def _peak_diff_bytes(a, b) -> int:
    with open_run(a) as la, open_run(b) as lb:
        tracemalloc.start()
        try:
            result = diff_logs(la, lb, "events")
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert result.equivalent
    return peak


def test_diff_memory_does_not_grow_with_log_length(tmp_path):
    for n in (8_000, 40_000):
        _synthetic_log(tmp_path / f"a{n}.db", n)
        _synthetic_log(tmp_path / f"b{n}.db", n)
    small = _peak_diff_bytes(tmp_path / "a8000.db", tmp_path / "b8000.db")
    large = _peak_diff_bytes(tmp_path / "a40000.db", tmp_path / "b40000.db")
    # 5x the events, about the same peak: only a chunk of each log is ever held.
    assert large < small * 1.3 + 256 * 1024, (small, large)
