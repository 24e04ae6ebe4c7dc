"""End to end: `orch run` with the fake env and trainer, then the invariants checked on the log by SQL."""

from __future__ import annotations

import re
import sqlite3
import subprocess

import pytest

from tests.support.cli import orch
from tests.support.logs import assert_log_invariants
from tests.support.runs import fake_run_args, sets


@pytest.mark.parametrize(
    "extra",
    [
        [],
        ["--set", "algorithm.finalize_in_background=true", "--set", "env.fake.error_rate=0.05"],
        [
            "--set",
            "algorithm.name=gar",
            "--set",
            "algorithm.gar.delay_s=0.005",
            "--set",
            "algorithm.max_finalizing_groups=2",
            "--set",
            "batch.token_size=300",
        ],
    ],
)
def test_fake_run_keeps_every_invariant(tmp_path, extra):
    steps = 120
    result = orch(
        *fake_run_args(tmp_path, "r", "--progress-every", "40", steps=steps),
        *sets("batch.size=32", "env.fake.empty_rate=0.02", "off_policy.max_off_policy_steps=1"),
        *sets("zero_output_batches=100000"),
        *extra,
    )
    assert result.returncode == 0, result.stderr
    assert "step  120/120" in result.stdout
    assert_log_invariants(tmp_path / "r", steps, max_off_policy=1, target_lag=1)


def test_a_run_of_several_samples_per_episode_ships_whole_groups_weighed_per_episode(tmp_path):
    """docs/rules.md, "Samples": 3 samples an episode, cut by whole groups, each weighing 1/3."""
    from orchestrator.core.batch import decode_batch
    from orchestrator.rundir import batch_path

    steps = 30
    result = orch(
        *fake_run_args(tmp_path, "r", steps=steps),
        *sets("batch.size=32", "batch.cut=groups", "env.fake.samples_per_episode=3", "zero_output_batches=100000"),
        *sets("log.batch_files=keep"),  # read back below
    )
    assert result.returncode == 0, result.stderr
    assert_log_invariants(tmp_path / "r", steps, max_off_policy=2, target_lag=1)
    groups_seen: dict[int, int] = {}
    for step in range(1, steps + 1):
        batch = decode_batch(batch_path(tmp_path / "r", step).read_bytes())
        assert 0 < len(batch) <= 32 and set(batch.sample_weight.tolist()) == {1 / 3}
        assert len(set(batch.sample_id.tolist())) == len(batch)
        assert all(len(batch.episode_id[batch.episode_id == e]) == 3 for e in set(batch.episode_id.tolist()))
        for group in set(batch.group_id.tolist()):
            assert groups_seen.setdefault(group, step) == step, f"group {group} split across batches"


def test_an_ok_episode_without_token_ids_is_a_failed_episode_with_the_reason(tmp_path):
    """An env that yields no sample for an ok episode (here the fake env, with no prompt and some
    empty completions): the episode fails with the reason, the run goes on."""
    result = orch(
        *fake_run_args(tmp_path, "r", steps=3),
        *sets("batch.size=16", "env.fake.prompt_tokens=0", "env.fake.empty_rate=0.3", "zero_output_batches=100000"),
    )
    assert result.returncode == 0, result.stderr
    db = sqlite3.connect(tmp_path / "r" / "events.db")
    failed = db.execute(
        "SELECT json_extract(data, '$.error') FROM events WHERE kind = 'episode_completed' "
        "AND NOT json_extract(data, '$.ok')"
    ).fetchall()
    assert failed and {error for (error,) in failed} == {
        "env: the episode yielded no sample (an ok episode without token ids)"
    }
    empty_ok = "SELECT count(*) FROM events WHERE kind = 'episode_completed' AND json_extract(data, '$.ok') "
    assert db.execute(empty_ok + "AND coalesce(json_extract(data, '$.tokens[0]'), 0) = 0").fetchone() == (0,)
    assert_log_invariants(tmp_path / "r", 3, max_off_policy=2, target_lag=1)


@pytest.mark.parametrize(
    "assignment, message",
    [
        ("batch.size=0", "batch.size: Input should be greater than or equal to 1"),
        ("batch.sample_weight=token", "batch.sample_weight: Input should be 'episode' or 'sample'"),
    ],
)
def test_bad_config_is_one_line_and_exit_2(tmp_path, assignment, message):
    result = orch(*fake_run_args(tmp_path), *sets(assignment))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [f"orch: error: invalid config: {message}"]


@pytest.mark.parametrize(
    "args, code, message",
    [
        (
            ["--progress-every", "0"],
            2,
            "orch: error: Invalid value for '--progress-every': 0 is not in the range x>=1. "
            "(see `python -m orchestrator.cli run --help`)",
        ),
        (
            ["--json-summary", "{tmp}/nodir/s.json"],
            2,
            "orch: error: --json-summary {tmp}/nodir/s.json: no such directory {tmp}/nodir",
        ),
        (
            ["--runs-dir", "{tmp}/afile/sub", "--name", "r"],
            2,
            "orch: error: cannot write in the runs dir {tmp}/afile/sub: Not a directory",
        ),
        (
            ["--set", "algorithm.name=gar", "--set", "algorithm.finalize_in_background=false"],
            2,
            "orch: error: invalid config: algorithm 'gar' calls a grader and must finalize in the background",
        ),
        (
            ["--env", "reverse_text"],
            2,
            "orch: error: invalid config: the embedded sampler samples from the trainer's published "
            "weights, which the fake trainer never writes; use trainer.kind='hf' (or the fake env)",
        ),
        (
            ["--set", "rollout.env_server=http://127.0.0.1:9"],
            2,
            "orch: error: invalid config: rollout: env_server is now env.reverse_text.server "
            "(the reverse_text env's own setting)",
        ),
        (
            ["--set", "env.reverse_text.server=localhost:9"],
            2,
            "orch: error: invalid config: env.reverse_text.server: server 'localhost:9' is not an "
            "http(s)://host[:port] URL",
        ),
        (
            ["--name", "../escape"],
            2,
            "orch: error: invalid run name '../escape': letters, digits and ._+=@- only, "
            "not starting with '.' or '-', at most 200 characters",
        ),
        (
            ["--name", "."],
            2,
            "orch: error: invalid run name '.': letters, digits and ._+=@- only, "
            "not starting with '.' or '-', at most 200 characters",
        ),
        (
            ["--name", "x" * 300],
            2,
            "orch: error: invalid run name '" + "x" * 300 + "': letters, digits and ._+=@- only, "
            "not starting with '.' or '-', at most 200 characters",
        ),
        (["--set", "max_steps=5"], 2, "orch: error: --max-steps and --set max_steps=... both set max_steps: give one"),
        (["--set", "envs=[]"], 2, "orch: error: --env and --set envs=... both set envs: give one"),
        (
            ["--set", "envs.reverse_text=0.5"],
            2,
            "orch: error: --env and --set envs.reverse_text=... both set envs: give one",
        ),
        (["--set", "trainer=[]"], 2, "orch: error: --trainer and --set trainer=... both set trainer.kind: give one"),
        (["--inference", ","], 2, "orch: error: --inference ',': no endpoint URL"),
        (
            ["--config", "{tmp}/binary.toml"],
            2,
            "orch: error: config file {tmp}/binary.toml is not UTF-8 text (invalid start byte at byte 0)",
        ),
    ],
)
def test_user_mistakes_are_one_line_before_anything_runs(tmp_path, args, code, message):
    (tmp_path / "afile").write_text("")
    (tmp_path / "binary.toml").write_bytes(b"\xff\xfe\x00")
    result = orch(*fake_run_args(tmp_path / "runs", None, *[a.format(tmp=tmp_path) for a in args], steps=2))
    assert result.returncode == code
    assert result.stderr.strip().splitlines()[-1] == message.format(tmp=tmp_path)
    assert "Traceback" not in result.stderr and not (tmp_path / "runs").exists()


def test_existing_run_needs_resume_and_missing_resume_is_an_error(tmp_path):
    args = fake_run_args(tmp_path, "r", steps=2)
    assert orch(*args).returncode == 0
    again = orch(*args)
    assert again.returncode == 2 and "already holds a run" in again.stderr and "Traceback" not in again.stderr
    missing = orch("run", "--resume", str(tmp_path / "nope"))
    assert missing.returncode == 2 and "no such run directory" in missing.stderr


def _fake_run(tmp_path, name: str, *args: str) -> subprocess.CompletedProcess:
    return orch(*fake_run_args(tmp_path, name, *sets("batch.size=16"), *args))


def test_a_renamed_run_dir_resumes_and_max_steps_below_the_shipped_batches_is_refused(tmp_path):
    assert _fake_run(tmp_path, "a", "--max-steps", "3").returncode == 0
    moved = tmp_path / "b"
    (tmp_path / "a").rename(moved)
    lowered = orch("run", "--resume", str(moved), "--max-steps", "2")
    assert lowered.returncode == 2 and lowered.stderr.strip().splitlines() == [
        f"orch: error: max_steps 2 is below the 3 batches {moved} already shipped; resume with --max-steps 3 or more"
    ]
    resumed = orch("run", "--resume", str(moved), "--max-steps", "5")
    assert resumed.returncode == 0, resumed.stderr
    assert_log_invariants(moved, 5, 2, 1)


def test_a_stored_config_that_is_not_json_is_one_line(tmp_path):
    assert _fake_run(tmp_path, "r", "--max-steps", "1").returncode == 0
    with sqlite3.connect(tmp_path / "r" / "events.db") as db:
        db.execute("UPDATE meta SET value = '{bad' WHERE key = 'config'")
    result = orch("run", "--resume", str(tmp_path / "r"))
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        f"orch: error: {tmp_path / 'r' / 'events.db'} is corrupted: the run's stored config is not a JSON object"
    ]


def test_a_batch_file_that_cannot_be_written_is_one_line_and_the_resume_writes_it(tmp_path):
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    (run_dir / "batches").write_text("not a directory")
    result = _fake_run(tmp_path, "r", "--max-steps", "2")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert (
        result.stderr.strip()
        .splitlines()[-1]
        .startswith(f"orch: error: cannot write the batch file {run_dir}/batches/")
    )
    assert result.stderr.strip().endswith(f"(continue it with `orch run --resume {run_dir}` once fixed)")
    (run_dir / "batches").unlink()
    resumed = orch("run", "--resume", str(run_dir))
    assert resumed.returncode == 0, resumed.stderr
    assert_log_invariants(run_dir, 2, 2, 1)


def test_an_interrupt_before_the_run_starts_exits_130_with_one_line(tmp_path, monkeypatch):
    """E.g. Ctrl-C or SIGTERM while a resume folds a long log (before the run's own handlers)."""
    from click.testing import CliRunner

    from orchestrator import cli
    from orchestrator.shell import runner

    def interrupted_fold(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "resume_run", interrupted_fold)
    (tmp_path / "r").mkdir()
    result = CliRunner().invoke(cli.main, ["run", "--resume", str(tmp_path / "r")])
    assert result.exit_code == 130
    assert result.stderr.strip().splitlines() == ["orch: error: interrupted before the run started; nothing was logged"]


def test_a_batch_file_past_the_logs_last_shipped_step_refuses_the_resume(tmp_path):
    """Batch files are written after their batch_shipped is committed: one past the log's last
    shipped step means the log lost committed events. Not overwritten: the trainer may have used it."""
    assert _fake_run(tmp_path, "r", "--max-steps", "2", *sets("log.batch_files=keep")).returncode == 0
    batches = tmp_path / "r" / "batches"
    (batches / "step_4.safetensors").write_bytes((batches / "step_2.safetensors").read_bytes())
    result = orch("run", "--resume", str(tmp_path / "r"), "--max-steps", "6")
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        f"orch: error: {batches} holds batch files for steps 4..4, but the log shipped only up to step 2: it lost "
        "committed events (its -wal file deleted or damaged?); move those files away to resume from the log as it is"
    ]
    assert (batches / "step_4.safetensors").read_bytes() == (batches / "step_2.safetensors").read_bytes()


def test_a_json_summary_dir_that_cannot_be_written_is_found_before_the_run(tmp_path):
    result = orch(*fake_run_args(tmp_path, None, "--json-summary", "/proc/s.json"))
    assert result.returncode == 2 and not (tmp_path / "r").exists()
    assert (
        result.stderr.strip()
        .splitlines()[-1]
        .startswith("orch: error: --json-summary /proc/s.json: cannot write in /proc: ")
    )


def test_set_name_names_the_run_and_a_resume_config_file_is_laid_over_the_stored_config(tmp_path):
    assert _fake_run(tmp_path, "x", "--max-steps", "2").returncode == 0  # --name x
    named = orch(*fake_run_args(tmp_path, None, *sets("name=by-set"), steps=1))
    assert named.returncode == 0 and (tmp_path / "by-set" / "events.db").exists(), named.stderr
    (tmp_path / "more.toml").write_text("max_steps = 4\n")  # says nothing of envs, trainer or batch size
    resumed = orch("run", "--resume", str(tmp_path / "x"), "--config", str(tmp_path / "more.toml"))
    assert resumed.returncode == 0, resumed.stderr
    assert_log_invariants(tmp_path / "x", 4, 2, 1)


def test_a_plain_resume_keeps_the_max_steps_an_earlier_resume_raised(tmp_path):
    assert _fake_run(tmp_path, "_r", "--max-steps", "2").returncode == 0  # a name may start with "_"
    assert orch("run", "--resume", str(tmp_path / "_r"), "--max-steps", "4").returncode == 0
    again = orch("run", "--resume", str(tmp_path / "_r"))  # what the stop and error lines tell users to run
    assert again.returncode == 2 and f"{tmp_path / '_r'} is complete at step 4; pass --max-steps 5" in again.stderr
    assert_log_invariants(tmp_path / "_r", 4, 2, 1)


def _stop_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 1, result.stderr
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("orch: error: ")]
    return line


def test_a_run_whose_env_always_fails_stops_in_one_line_blaming_the_env(tmp_path):
    result = orch(*fake_run_args(tmp_path, "r", steps=5), *sets("env.fake.error_rate=1", "zero_output_batches=1"))
    line = _stop_line(result)
    assert re.match(
        r"orch: error: run stopped: zero_output: every one of the last \d+ episodes failed; "
        r"the last: env: FakeEpisodeError: ",
        line,
    ), line
    failed = sqlite3.connect(tmp_path / "r" / "events.db").execute(
        "SELECT json_extract(data, '$.error') FROM events WHERE kind = 'episode_completed' LIMIT 1"
    )
    assert failed.fetchone()[0].startswith("env: FakeEpisodeError: fake env: episode ")


def test_a_run_that_samples_no_token_says_so_when_it_stops_for_zero_output(tmp_path):
    result = orch(*fake_run_args(tmp_path, "r", steps=5), *sets("env.fake.empty_rate=1", "zero_output_batches=1"))
    line = _stop_line(result)
    assert re.fullmatch(
        r"orch: error: run stopped: zero_output: no tokens sampled: (\d+) of the last \1 episodes came back "
        r"without a sampled token \(docs/rules.md, Samples\)",
        line,
    ), line


def test_a_run_whose_groups_all_tie_names_the_rewards_and_the_settings(tmp_path):
    """Groups of one episode: every advantage is zero, every group is rejected (the fake env's
    rewards differ between tasks, never within a group of one)."""
    result = orch(*fake_run_args(tmp_path, "r", steps=5), *sets("rollout.group_size=1", "zero_output_batches=1"))
    line = _stop_line(result)
    assert re.fullmatch(
        r"orch: error: run stopped: zero_output: every group's rewards were equal, so every advantage was zero "
        r"and no group was admitted for training \(rewards \d\.\d{3}\.\.\d\.\d{3}, equal within each group, of "
        r"the last \d+ scored episodes\): groups of one episode have none to differ from: raise rollout.group_size; "
        r"zero_output_batches \(1\) is how long a run waits for one",
        line,
    ), line


def test_a_run_whose_groups_go_stale_names_the_stale_cancellations_not_equal_rewards(tmp_path):
    """A slow background grader (gar) and no off-policy slack: the first batch ships while the
    other groups are still being scored, and their work, a version old, can no longer train
    (cancelled as stale); the stop line says so, not that the rewards were equal."""
    result = orch(
        *fake_run_args(tmp_path, "r", steps=20),
        *sets(
            "algorithm.name=gar",
            "algorithm.gar.delay_s=0.3",
            "algorithm.gar.jitter_s=0",
            "off_policy.max_off_policy_steps=0",
            "off_policy.target_lag=0",
            "rollout.capacity=off",
            "rollout.group_size=4",
            "batch.size=8",
            "zero_output_batches=1",
        ),
    )
    line = _stop_line(result)
    stale = sqlite3.connect(tmp_path / "r" / "events.db").execute(
        "SELECT count(*) FROM events WHERE kind = 'group_cancelled' AND json_extract(data, '$.reason') = 'stale'"
    )
    assert stale.fetchone()[0] >= 1  # the precondition: groups were cancelled as stale
    assert re.fullmatch(
        r"orch: error: run stopped: zero_output: no group was admitted for training since the last one: "
        r"(\d+) groups cancelled as stale, \d+ completed samples dropped as stale.*: the work was too old to train "
        r"once scored: rollout.max_inflight, rollout.capacity, off_policy.max_off_policy_steps, "
        r"off_policy.target_lag; zero_output_batches \(1\) is how long a run waits for one",
        line,
    ), line
    assert "equal" not in line


def test_a_pipe_hears_of_the_first_episodes_before_the_first_step(tmp_path):
    """A first batch can take a while: the episodes done so far are said before it ships."""
    result = orch(*fake_run_args(tmp_path, "r", steps=1), *sets("env.fake.latency_s=0.05"))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    sampling = next(i for i, line in enumerate(lines) if line.startswith("sampling: "))
    assert re.fullmatch(
        r"sampling: \d+ episodes done after \d+\.\ds, \d+ in flight; a step ships a batch of \d+ samples",
        lines[sampling],
    )
    assert sampling < next(i for i, line in enumerate(lines) if line.startswith("step "))
