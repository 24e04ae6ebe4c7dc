"""`orch plot` and `orch export`: a run's log as a figure and as analysis tables. Registered by
orchestrator.cli. Bad input (a missing or foreign log, an output that cannot be written) is one
line on stderr and exit 2, checked before anything is read."""

from __future__ import annotations

import sys
from contextlib import ExitStack
from pathlib import Path

import click

from eventlog import LogError
from orchestrator.core.evolve import FoldError
from replay.source import ReplayInputError, one_line, open_run

EXIT_BAD_INPUT = 2


def _fail(message: str) -> None:
    click.echo(f"orch: error: {one_line(message)}", err=True)
    sys.exit(EXIT_BAD_INPUT)


def _check_output(out: Path, what: str) -> None:
    if not out.parent.is_dir():
        raise ReplayInputError(f"{what} {out}: no such directory {out.parent}")
    if out.is_dir():
        raise ReplayInputError(f"{what} {out} is a directory")


@click.command("plot", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("runs", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    metavar="FILE.png",
    help="where to write the figure  [default: RUN/plot.png of the first RUN]",
)
def plot_command(runs: tuple[Path, ...], out: Path | None) -> None:
    """One figure of RUN's curves per step (reward, off-policy lag, waste, episodes/s, tokens/s,
    buffered and finalizing, trainer loss, mismatch KL), read from its log; several runs are
    overlaid. RUN: a run directory or its events.db."""
    from orchestrator.observe.plot import plot_runs, series

    try:
        first = runs[0] if runs[0].is_dir() else runs[0].parent
        out = out or first / "plot.png"
        _check_output(out, "--out")
        with ExitStack() as stack:
            logs = [stack.enter_context(open_run(run)) for run in runs]
            data = [(_label(run), series(log)) for run, log in zip(runs, logs)]
        plot_runs(data, out)
    except (ReplayInputError, FoldError) as err:
        _fail(str(err))
    except OSError as err:
        _fail(f"cannot write {out}: {err.strerror or err}")
    click.echo(f"orch: wrote {out}")


@click.command("export", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("run", type=click.Path(path_type=Path))
@click.argument("out", type=click.Path(dir_okay=False, path_type=Path), metavar="OUT.db")
@click.option("--replace", is_flag=True, help="overwrite OUT.db if it exists")
@click.option("--no-text", is_flag=True, help="leave the episodes' text column NULL (a smaller file, no tokenizer)")
@click.option(
    "--tokenizer",
    type=click.Path(file_okay=False, path_type=Path),
    help="decode the text column with this tokenizer dir  [default: the run's own]",
)
def export_command(run: Path, out: Path, replace: bool, no_text: bool, tokenizer: Path | None) -> None:
    """RUN's log as flat analysis tables in a new SQLite file OUT.db (episodes, groups, batches,
    versions; typed, indexed, full-text search on error messages; each episode's completion as
    text): open it with Datasette or any SQLite tool. RUN: a run directory or its events.db."""
    from orchestrator.observe.export import export_run
    from orchestrator.observe.text import NoTokenizer, run_decoder

    try:
        _check_output(out, "OUT.db")
        if out.exists() and not replace:
            raise ReplayInputError(f"{out} exists; pass --replace to overwrite it")
        with open_run(run) as log:
            decoder = None
            if not no_text:
                try:
                    decoder = run_decoder(run, log.meta.get("config"), tokenizer)
                except NoTokenizer as err:
                    click.echo(f"orch: note: the episodes' text column is left NULL: {err}", err=True)
            counts = export_run(log, out, decoder, note=lambda line: click.echo(f"orch: note: {line}", err=True))
    except (ReplayInputError, FoldError, LogError) as err:  # LogError: damage met mid-read
        _fail(str(err))
    except OSError as err:
        _fail(f"cannot write {out}: {err.strerror or err}")
    click.echo(f"orch: wrote {out} (" + ", ".join(f"{name} {n}" for name, n in counts.items()) + ")")


def _label(run: Path) -> str:
    """A run's name in the legend: its directory's name."""
    return run.name if run.is_dir() else run.parent.name
