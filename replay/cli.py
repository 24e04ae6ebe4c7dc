"""`orch replay`: state at any seq, diff two runs, re-execute a run on another finalize path, check
determinism. Registered by orchestrator.cli as the `replay` command (`replay_command`).

Exit codes: 0 equivalent / deterministic / summary shown; 1 divergent (or, for the summary, the
conservation check fails); 2 bad input (missing, foreign or corrupted log, bad options), with a
one-line message on stderr.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click
import orjson

from eventlog import LogError
from replay.diff import LEVELS
from replay.reexec import SETTLE_ORDERS
from replay.source import ReplayInputError, log_error_line, one_line

EXIT_OK, EXIT_DIVERGENT, EXIT_BAD_INPUT = 0, 1, 2


def _fail(message: str) -> None:
    click.echo(f"orch: error: {one_line(message)}", err=True)
    sys.exit(EXIT_BAD_INPUT)


def _console():
    from rich.console import Console

    out = sys.stdout  # looked up now: click's test runner swaps it
    return Console(file=out, highlight=False, width=None if out.isatty() else 120)


def _emit_json(obj) -> None:
    click.echo(orjson.dumps(obj, option=orjson.OPT_SORT_KEYS | orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS).decode())


@click.command("replay", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("run", required=False, type=click.Path(path_type=Path))
@click.option("--at", "at", type=int, metavar="SEQ", help="state after event SEQ (default: the end)")
@click.option("--json", "as_json", is_flag=True, help="stable JSON (sorted keys) instead of tables")
@click.option(
    "--diff",
    "diff_paths",
    nargs=2,
    type=click.Path(path_type=Path),
    metavar="A B",
    help="compare two runs (run dirs or events.db paths)",
)
@click.option(
    "--level",
    type=click.Choice(LEVELS),
    default=None,
    help="what must be equal for --diff/--reexecute  [default: batches]",
)
@click.option("--check", is_flag=True, help="re-derive every decision from the recorded inputs")
@click.option("--reexecute", is_flag=True, help="feed RUN's recorded inputs through decide into --out")
@click.option("--finalize", type=click.Choice(["inline", "background"]), help="--reexecute: the finalize path")
@click.option(
    "--settle-order",
    type=click.Choice(SETTLE_ORDERS),
    default=None,
    help="--reexecute background: when results are delivered  [default: recorded]",
)
@click.option("--seed", type=int, default=None, help="--settle-order shuffled: RNG seed  [default: 0]")
@click.option("--out", type=click.Path(path_type=Path), metavar="NEW", help="--reexecute: new run dir (or .db path)")
@click.option("--episode", type=int, metavar="ID", help="the episode's completion, token arrays included, as JSON")
@click.option("--text", is_flag=True, help="--episode: its prompt and completion decoded with the run's tokenizer")
@click.option(
    "--tokenizer",
    type=click.Path(file_okay=False, path_type=Path),
    help="--text: decode with this tokenizer dir  [default: the run's own]",
)
def replay_command(
    run, at, as_json, diff_paths, level, check, reexecute, finalize, settle_order, seed, out, episode, text, tokenizer
) -> None:
    """Replay a run's log (RUN: a run directory or its events.db).

    \b
      orch replay RUN [--at SEQ] [--json]       state: step, version, pending samples, open and
                                                finalizing groups, accounting, conservation
      orch replay --diff A B [--level LEVEL]    first divergence of two runs (streamed)
      orch replay RUN --reexecute --finalize inline|background
                  [--settle-order recorded|immediate|shuffled [--seed N]] --out NEW
                                                RUN's inputs through decide on that path, then --diff
      orch replay RUN --check                   re-derive every decision with the current code
      orch replay RUN --episode ID              the episode's completion (token ids, mask,
                                                logprobs included): one JSON line per completion
                  [--text [--tokenizer DIR]]    with its prompt_text and completion_text

    Exit status: 0 equivalent / deterministic; 1 divergent (for the state summary: the
    conservation check fails); 2 bad input (one line on stderr), a damaged log included: --check
    names the damaged row rather than blame the code.
    """
    flags = (
        ("--diff", bool(diff_paths)),
        ("--check", check),
        ("--reexecute", reexecute),
        ("--episode", episode is not None),
    )
    modes = [name for name, on in flags if on]
    try:
        if len(modes) > 1:
            raise ReplayInputError(f"{' and '.join(modes)} cannot be combined")
        mode = modes[0] if modes else "summary"
        if mode == "--diff" and run is not None:
            raise ReplayInputError("--diff takes its two runs as A B; do not give RUN as well")
        if mode != "--diff" and run is None:
            raise ReplayInputError("missing RUN (a run directory or its events.db)")
        if at is not None and mode != "summary":
            raise ReplayInputError("--at applies to the state summary only")
        if level is not None and mode not in ("--diff", "--reexecute"):
            raise ReplayInputError("--level applies to --diff and --reexecute")
        if mode != "--episode" and (text or tokenizer):
            raise ReplayInputError("--text/--tokenizer apply to --episode only")
        if tokenizer is not None and not text:
            raise ReplayInputError("--tokenizer applies to --text only")
        if mode != "--reexecute" and (finalize or settle_order or seed is not None or out):
            raise ReplayInputError("--finalize/--settle-order/--seed/--out apply to --reexecute only")
        if mode == "--reexecute":
            if not finalize or not out:
                raise ReplayInputError("--reexecute needs --finalize inline|background and --out NEW")
            if finalize == "inline" and (settle_order or seed is not None):
                raise ReplayInputError("--settle-order/--seed apply to --finalize background only")
            if seed is not None and settle_order != "shuffled":
                raise ReplayInputError("--seed applies to --settle-order shuffled only")
        level = level or "batches"
        if mode == "summary":
            code = _summary(run, at, as_json)
        elif mode == "--diff":
            a, b = diff_paths
            code = _diff(a, b, level, as_json)
        elif mode == "--check":
            code = _check(run, as_json)
        elif mode == "--episode":
            code = _episode(run, episode, text, tokenizer)
        else:
            code = _reexecute(run, out, finalize, settle_order or "recorded", seed or 0, level, as_json)
    except ReplayInputError as err:
        _fail(str(err))
    except LogError as err:
        _fail(log_error_line(err))
    sys.exit(code)


def _summary(run: Path, at: int | None, as_json: bool) -> int:
    from replay.source import open_run
    from replay.summary import fold_run, render, summarize

    with open_run(run) as log:
        summary = summarize(fold_run(log, at), log)
    if as_json:
        _emit_json(summary)
    else:
        render(summary, _console())
    return EXIT_OK if summary["conservation"]["holds"] else EXIT_DIVERGENT


def _episode(run: Path, episode_id: int, text: bool, tokenizer: Path | None) -> int:
    from replay.episode import episode_completions, with_text
    from replay.source import open_run

    with open_run(run) as log:
        completions = episode_completions(log, episode_id)
        stored_config = log.meta.get("config")
    if not completions:
        raise ReplayInputError(f"{run}: episode {episode_id} has no episode_completed event")
    if text:
        completions = with_text(completions, run, stored_config, tokenizer)
    for completion in completions:
        click.echo(orjson.dumps(completion).decode())
    return EXIT_OK


def _diff(a: Path, b: Path, level: str, as_json: bool) -> int:
    from replay.diff import diff_logs, render_result
    from replay.source import open_run

    with open_run(a) as log_a, open_run(b) as log_b:
        result = diff_logs(log_a, log_b, level)
    if as_json:
        _emit_json(result.to_dict())
    else:
        render_result(result, _console())
    return EXIT_OK if result.equivalent else EXIT_DIVERGENT


def _check(run: Path, as_json: bool) -> int:
    from replay.check import check_log
    from replay.diff import render_divergence
    from replay.source import open_run

    with open_run(run) as log:
        result = check_log(log)
    if as_json:
        _emit_json(result.to_dict())
        if result.damage is not None:
            return EXIT_BAD_INPUT
    elif result.damage is not None:
        raise ReplayInputError(f"{result.path} is damaged: {result.damage}")
    elif result.deterministic:
        click.echo(f"deterministic: {result.decisions} decisions re-derived from {result.inputs} inputs")
    else:
        assert result.divergence is not None, "a log that is not deterministic has a divergence"
        console = _console()
        console.print(f"NOT deterministic: {result.decisions} decisions re-derived identically, then:")
        render_divergence(result.divergence, console, "recorded", "current code")
    return EXIT_OK if result.deterministic else EXIT_DIVERGENT


def _reexecute(run: Path, out: Path, finalize: str, settle_order: str, seed: int, level: str, as_json: bool) -> int:
    from replay.diff import diff_logs, render_result
    from replay.reexec import ReexecOptions, reexecute
    from replay.source import open_run

    options = ReexecOptions(finalize=finalize, settle_order=settle_order, seed=seed)
    with open_run(run) as source:
        report = reexecute(source, out, options)
        with open_run(report.out) as new:
            result = diff_logs(source, new, level)
    ok = result.equivalent and report.halted is None
    if as_json:
        _emit_json({"reexecute": report.to_dict(), "diff": result.to_dict(), "equivalent": ok})
        return EXIT_OK if ok else EXIT_DIVERGENT
    console = _console()
    order = (
        f", settle order {settle_order}" + (f" (seed {seed})" if settle_order == "shuffled" else "")
        if finalize == "background"
        else ""
    )
    console.print(
        f"re-executed {report.source} with --finalize {finalize}{order} into {report.out}: "
        f"{report.inputs_fed} inputs fed, {report.events_written} events written, "
        f"results reused {report.results_reused} / computed {report.results_computed}, "
        f"late inputs {report.late_inputs}, publishes ahead {report.publishes_ahead}; "
        + (f"stopped: {report.stop_reason}" if report.stopped else "not stopped")
    )
    if report.halted is not None:
        h = report.halted
        if h["kind"] == h["input_kind"]:
            console.print(
                f"DIVERGENT: the re-executed run cannot accept the recorded input at seq {h['seq']} "
                f"({h['kind']}): {h['reason']}"
            )
        else:  # a decision made on that input is the one nobody can answer
            console.print(
                f"DIVERGENT: the re-executed run cannot serve its {h['kind']} decision on the recorded "
                f"input at seq {h['seq']} ({h['input_kind']}): {h['reason']}"
            )
    render_result(result, console)
    return EXIT_OK if ok else EXIT_DIVERGENT
