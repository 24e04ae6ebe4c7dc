"""`orch run`'s progress: on a terminal a live bar with an ETA under the step lines; in a pipe, the plain lines."""

from __future__ import annotations

import io
import os
import pty
import re
import select
import subprocess

import orjson
import pytest
from rich.console import Console

from orchestrator.core.events import BatchShipped, CoreParams
from orchestrator.core.state import initial_state
from orchestrator.shell.progress import Progress
from tests.support.cli import orch, orch_argv
from tests.support.runs import fake_run_args


def _ship(progress: Progress, steps: range, max_steps: int) -> None:
    state = initial_state(CoreParams(max_steps=max_steps))
    for step in steps:
        state.version = step - 1
        progress.on_batch(
            BatchShipped(
                step=step,
                sample_ids=[],
                sha256="0" * 64,
                n_tokens=0,
                off_policy_max=1,
                off_policy_mean=0.5,
                reward_mean=0.25,
            ),
            state,
            None,
        )


def test_a_terminal_gets_the_live_bar_with_an_eta_and_every_step_line():
    out = io.StringIO()
    progress = Progress(Console(file=out, force_terminal=True, width=160, highlight=False, soft_wrap=True))
    with progress.live(total_steps=4, done_steps=1):  # a resume: step 1 was done before
        _ship(progress, range(2, 5), 4)
    text = out.getvalue()
    assert "\x1b[?25l" in text and text.endswith("\x1b[?25h")  # a live display: cursor hidden, then shown again
    for step in (2, 3, 4):
        assert f"step    {step}/4 | reward 0.250" in text
    assert "━" in text and "ETA" in text
    final_bar = text.rsplit("\r", 1)[-1]
    assert "4/4" in final_bar and "ETA" in final_bar


def test_a_pipe_gets_the_plain_lines_only():
    out = io.StringIO()
    progress = Progress(Console(file=out, highlight=False, soft_wrap=True))
    with progress.live(total_steps=3, done_steps=0):
        _ship(progress, range(1, 4), 3)
    lines = out.getvalue().splitlines()
    assert [re.sub(r"\| \d+\.\d\ds \|", "| T |", line) for line in lines] == [
        f"step    {s}/3 | reward 0.250 | lag 0.50 max 1 | v{s - 1} | waste 0.0% | T | buffered 0 in-flight 0"
        for s in (1, 2, 3)
    ]
    assert "\x1b" not in out.getvalue() and "ETA" not in out.getvalue()


def _busy_state(max_steps: int):
    """A state whose step line is long: four-digit steps and queue, a lag of two digits, an eval."""
    from orchestrator.core.state import EvalResult

    state = initial_state(CoreParams(max_steps=max_steps))
    state.version = 999
    state.inflight = {i: None for i in range(1024)}
    state.finalizing = {"reverse_text": 12}
    state.evals.results.append(
        EvalResult(
            eval_id=1,
            env="reverse_text",
            version=998,
            reward_mean=0.5,
            pass_at_1=None,
            pass_at_k=None,
            k=1,
            scored=8,
            tokens=80,
        )
    )
    return state


@pytest.mark.parametrize("width", [100, 80])
def test_a_long_step_line_fits_a_terminal_of_100_or_80_columns_folded_at_its_separators(width):
    from orchestrator.shell.progress import step_parts

    event = BatchShipped(
        step=1000,
        sample_ids=[],
        sha256="0" * 64,
        n_tokens=0,
        off_policy_max=12,
        off_policy_mean=10.25,
        reward_mean=0.25,
    )
    state = _busy_state(1000)
    whole = " | ".join(step_parts(event, state, 123.45))
    assert len(whole) > 100  # the case to fold
    out = io.StringIO()
    progress = Progress(Console(file=out, force_terminal=True, width=width, highlight=False, soft_wrap=True))
    progress.on_batch(event, state, None)
    lines = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.getvalue()).splitlines()
    assert len(lines) == 2 and all(len(line) <= width for line in lines), lines
    assert lines[0].startswith("step 1000/1000 | reward 0.250 | lag 10.25 max 12 | v999 | waste")
    assert lines[1].startswith("    ")  # the continuation, indented
    printed = [part.strip() for line in lines for part in line.split(" | ")]
    assert [p for p in printed if not p.endswith("s")] == [
        p for p in step_parts(event, state, 0) if not p.endswith("s")
    ]


def test_a_pipe_never_folds_and_a_common_step_line_fits_100_columns():
    from orchestrator.shell.progress import step_parts

    event = BatchShipped(
        step=40, sample_ids=[], sha256="0" * 64, n_tokens=0, off_policy_max=1, off_policy_mean=0.5, reward_mean=0.25
    )
    state = _busy_state(40)
    state.finalizing = {}
    state.evals.results.clear()
    state.inflight = {i: None for i in range(128)}
    state.version = 39
    state.acct.dropped = {"stale": 116}
    state.acct.completed_samples = 1000
    line = " | ".join(step_parts(event, state, 12.34))
    assert "waste 11.6% | 12.3s | buffered 0 in-flight 128" in line and len(line) <= 100, line
    out = io.StringIO()
    progress = Progress(Console(file=out, width=40, highlight=False, soft_wrap=True))
    progress.on_batch(event, _busy_state(40), None)
    assert len(out.getvalue().splitlines()) == 1


def test_the_live_bar_shows_the_reward_and_lag_within_80_columns():
    out = io.StringIO()
    progress = Progress(Console(file=out, force_terminal=True, width=80, highlight=False, soft_wrap=True))
    with progress.live(total_steps=40, done_steps=0):
        _ship(progress, range(1, 3), 40)
    plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.getvalue())
    bars = [part for part in re.split(r"[\r\n]", plain) if "ETA" in part]
    assert bars and "2/40 reward 0.250 lag 0.50 ETA" in bars[-1]
    assert all(len(bar.rstrip()) <= 80 for bar in bars)


def test_before_the_first_step_the_progress_tells_what_sampling_did():
    state = initial_state(CoreParams(max_steps=4, batch_size=64))
    state.acct.completed = 3
    state.inflight = {i: None for i in range(5)}
    out = io.StringIO()
    progress = Progress(Console(file=out, highlight=False, soft_wrap=True))
    progress.on_commit(state)
    progress.on_commit(state)  # once in a pipe
    (line,) = out.getvalue().splitlines()
    assert re.fullmatch(
        r"sampling: 3 episodes done after \d+\.\ds, 5 in flight; a step ships a batch of 64 samples", line
    )
    terminal = io.StringIO()
    progress = Progress(Console(file=terminal, force_terminal=True, width=100, highlight=False, soft_wrap=True))
    with progress.live(total_steps=4, done_steps=0):
        progress.on_commit(state)
        progress._bar.refresh()
    assert "sampling: 3 episodes done, 5 in flight" in terminal.getvalue()


def test_orch_run_in_a_pipe_prints_plain_lines(tmp_path):
    result = orch(*fake_run_args(tmp_path, "r", steps=3))
    assert result.returncode == 0, result.stderr
    steps = [line for line in result.stdout.splitlines() if line.startswith("step ")]
    assert [line.split(" | ")[0] for line in steps] == ["step    1/3", "step    2/3", "step    3/3"]
    assert "ETA" not in result.stdout and "\x1b" not in result.stdout


def test_orch_run_on_a_terminal_shows_the_live_bar(tmp_path):
    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        orch_argv(*fake_run_args(tmp_path, "r", steps=3)),
        stdin=subprocess.DEVNULL,
        stdout=follower,
        stderr=follower,
        env={**os.environ, "COLUMNS": "160"},
    )
    os.close(follower)
    chunks = []
    try:
        while True:  # until the child closes its end of the terminal
            if not select.select([leader], [], [], 120)[0]:
                raise AssertionError("orch run wrote nothing for 120 s")
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # EIO: every writer is gone
                break
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(leader)
        if proc.poll() is None:
            proc.kill()
    assert proc.wait(timeout=120) == 0
    plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", b"".join(chunks).decode(errors="replace"))
    assert "step    3/3 | reward" in plain
    bars = [part for part in re.split(r"[\r\n]", plain) if "ETA" in part]
    assert bars and "3/3" in bars[-1]  # the live bar, complete at the end


def test_the_reward_gain_of_a_short_run_compares_halves_and_one_step_is_n_a():
    from orchestrator.shell.progress import reward_windows

    assert reward_windows([0.1, 0.2, 0.6]) == ([0.1], [0.6])  # never the same steps on both sides
    assert reward_windows([0.1, 0.2, 0.3, 0.4]) == ([0.1, 0.2], [0.3, 0.4])
    assert reward_windows([float(i) for i in range(12)]) == ([0.0, 1.0, 2.0, 3.0, 4.0], [7.0, 8.0, 9.0, 10.0, 11.0])
    assert reward_windows([0.5]) == ([0.5], [])
    assert reward_windows([]) == ([], [])


def test_a_three_step_runs_summary_shows_a_real_gain_and_a_one_step_run_n_a(tmp_path):
    for steps, gain in ((3, None), (1, "n/a")):
        fake = ("--env", "fake", "--trainer", "fake", "--runs-dir", str(tmp_path), "--name", f"r{steps}")
        result = orch("run", *fake, "--max-steps", str(steps), "--json-summary", str(tmp_path / f"s{steps}.json"))
        assert result.returncode == 0, result.stderr
        summary = orjson.loads((tmp_path / f"s{steps}.json").read_bytes())
        row = next(line for line in result.stdout.splitlines() if "reward_gain" in line)
        if gain is None:
            assert summary["reward_gain"] == summary["reward_last5"] - summary["reward_first5"]
        else:
            assert summary["reward_gain"] is None and gain in row


def test_a_resumed_runs_summary_separates_this_segment_from_the_runs_totals(tmp_path):
    fake = ("--env", "fake", "--trainer", "fake")
    first = orch("run", *fake, "--runs-dir", str(tmp_path), "--name", "r", "--max-steps", "3")
    assert first.returncode == 0, first.stderr
    out = tmp_path / "s.json"
    resumed = orch("run", "--resume", str(tmp_path / "r"), "--max-steps", "5", "--json-summary", str(out))
    assert resumed.returncode == 0, resumed.stderr
    summary = orjson.loads(out.read_bytes())
    assert (summary["steps"], summary["segment_first_step"], summary["run_steps"]) == (2, 4, 5)
    text = resumed.stdout
    assert "orch run summary: this segment (steps 4..5), then the whole run" in text
    rows = {
        line.split("│")[1].strip(): line.split("│")[2].strip() for line in text.splitlines() if line.count("│") == 3
    }
    assert rows["steps (this segment)"] == "2" and rows["steps (the run)"] == "5"
    assert "reward_gain (this segment)" in rows and "steps" not in rows
    assert int(rows["trained_episodes"]) == summary["trained_episodes"] > 0  # the run's totals, every segment


def test_the_drops_of_a_drain_or_a_stop_are_not_waste():
    """A Ctrl-C drains the run: what it cancels is the run's end, not its settings' waste."""
    from orchestrator.core.state import wasted_samples

    state = initial_state(CoreParams(max_steps=4))
    state.acct.completed_samples = 200
    state.acct.dropped = {"stale": 10, "drain": 127, "stop": 3}
    assert wasted_samples(state.acct) == 10
    out = io.StringIO()
    progress = Progress(Console(file=out, width=200, highlight=False, soft_wrap=True))
    summary = progress.summary(state, "r")
    assert summary["waste_pct"] == 5.0 and summary["dropped_by_reason"]["drain"] == 127
    event = BatchShipped(
        step=1, sample_ids=[], sha256="0" * 64, n_tokens=0, off_policy_max=0, off_policy_mean=0.0, reward_mean=0.5
    )
    progress.on_batch(event, state, None)
    assert "| waste 5.0% |" in out.getvalue()


def test_every_drop_reason_is_listed_once_with_whether_it_is_waste():
    """One list of drop reasons (`DROP_REASONS`) is what an event may carry and what the step
    line's waste and the waste warning count: a reason added to the events but not the list
    fails here."""
    from typing import get_args, get_type_hints

    from orchestrator.core import events as ev
    from orchestrator.core.state import DROP_REASONS

    reasons = set(get_args(ev.DropReason))
    assert reasons == set(DROP_REASONS)
    for model in (ev.GroupCancelled, ev.TracesDropped):
        assert set(get_args(get_type_hints(model)["reason"])) <= reasons, model
    assert get_args(get_type_hints(ev.GroupSettled)["dropped"])[0] == ev.DropReason
    with pytest.raises(ValueError):
        ev.checked(ev.GroupSettled, group_id=1, admitted=False, sample_ids=[], dropped={"unlisted": [1]})


def test_overload_and_damaged_drops_are_waste_on_the_step_line_and_in_the_warning():
    """The step line's waste and the waste warning count the same drops."""
    state = initial_state(CoreParams(max_steps=20))
    warnings: list[str] = []
    out = io.StringIO()
    progress = Progress(Console(file=out, width=300, highlight=False, soft_wrap=True), warn=warnings.append)
    for step in range(1, 8):
        state.acct.shipped += 10
        state.acct.completed_samples += 30
        state.acct.dropped = {"overload": 10 * step, "damaged": 10 * step, "drain": 5 * step}
        event = BatchShipped(
            step=step,
            sample_ids=[],
            sha256="0" * 64,
            n_tokens=0,
            off_policy_max=0,
            off_policy_mean=0.0,
            reward_mean=0.5,
        )
        progress.on_batch(event, state, None)
    assert f"| waste {140 / 210:.1%} |" in out.getvalue()
    assert len(warnings) == 1 and "overload 50:" in warnings[0] and "damaged 50: traces whose" in warnings[0]
    assert "drain" not in warnings[0]
