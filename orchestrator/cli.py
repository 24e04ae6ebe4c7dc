"""`orch`: run, resume, replay, and the helper processes (trainer, env server).

Exit codes, one rule for every command (README "Mistakes"): 2 when orch refuses before anything
runs (a usage error, a bad config, a missing, existing, foreign, damaged or locked run or log),
1 when a run that started fails (its message says how to resume), 130 on an interrupt. Each
error is one line on stderr, `orch: error: ...`; a traceback is printed only for a genuine crash.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import tempfile
import time
import traceback
from importlib.metadata import version as dist_version
from pathlib import Path

import click
import orjson

from eventlog import LogError
from orchestrator.config import ENVS, TRAINERS, ConfigError, load_config
from orchestrator.quick_exit import exit_process

EXIT_ERROR, EXIT_USAGE, EXIT_INTERRUPTED = 1, 2, 130


def fail(message: str, code: int = EXIT_ERROR) -> None:
    click.echo(f"orch: error: {message}", err=True)
    sys.exit(code)


class OneLineErrors(click.Group):
    """click's usage errors (a bad option value, an unknown option or choice) as one line, like
    every other error of orch, with the command's --help named instead of its usage text."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.UsageError as err:
            command = err.ctx.command_path if err.ctx is not None else "orch"
            fail(f"{err.format_message()} (see `{command} --help`)", EXIT_USAGE)
        except click.ClickException as err:
            fail(err.format_message(), err.exit_code)
        except click.Abort:
            fail("aborted", EXIT_INTERRUPTED)
        sys.exit(code if isinstance(code, int) else 0)


@click.group(cls=OneLineErrors, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(dist_version("orch"), prog_name="orch")
def main() -> None:
    """orch: an asynchronous RL orchestrator whose every decision is an event in a SQLite log."""


@main.command("run")
@click.option("--config", "config_file", type=click.Path(dir_okay=False, path_type=Path), help="TOML config file")
@click.option(
    "--set", "overrides", multiple=True, metavar="KEY=VALUE", help="override a config field (dotted), repeatable"
)
@click.option("--name", help="run name (default: run-YYYYmmdd-HHMMSS)")
@click.option("--runs-dir", type=click.Path(file_okay=False, path_type=Path), help="where runs live (default: runs)")
@click.option(
    "--env",
    "env_name",
    help=f"shorthand for envs={{ENV: 1}}: {', '.join(ENVS.names())}, an installed plugin's name or a module:Attribute",
)
@click.option(
    "--trainer",
    "trainer_kind",
    help=f"shorthand for trainer.kind: {', '.join(TRAINERS.names())}, an installed plugin's name or a module:Attribute",
)
@click.option("--max-steps", type=int, help="shorthand for max_steps")
@click.option(
    "--inference",
    "inference_urls",
    metavar="URL1,URL2,...",
    help="sample with these OpenAI-compatible endpoints (orch serve, vLLM, SGLang); shorthand for "
    "inference.openai.endpoints",
)
@click.option(
    "--resume",
    "resume_dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="continue the run in this directory",
)
@click.option(
    "--drop-damaged",
    is_flag=True,
    help="with --resume: drop the never-shipped traces whose payload files are missing or damaged "
    "(logged as events) and continue",
)
@click.option(
    "--progress-every",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="print a progress line every N steps",
)
@click.option(
    "--json-summary", type=click.Path(dir_okay=False, path_type=Path), help="also write the final summary as JSON"
)
def run_command(
    config_file,
    overrides,
    name,
    runs_dir,
    env_name,
    trainer_kind,
    max_steps,
    inference_urls,
    resume_dir,
    drop_damaged,
    progress_every,
    json_summary,
) -> None:
    """Run (or --resume) an RL job; the default is the embedded reverse-text job."""
    from orchestrator.fold import FoldError
    from orchestrator.observe.sinks import SinkUnavailable
    from orchestrator.shell.compose import run_job
    from orchestrator.shell.loop import FinalizeError
    from orchestrator.shell.progress import Progress
    from orchestrator.shell.runner import RunDirError, create_run, resume_run

    if json_summary is not None:  # found out now, not after the run
        if not json_summary.parent.is_dir():
            fail(f"--json-summary {json_summary}: no such directory {json_summary.parent}", EXIT_USAGE)
        try:  # a real probe: permission bits say little to root or on /proc
            tempfile.TemporaryFile(dir=json_summary.parent).close()
        except OSError as err:
            fail(f"--json-summary {json_summary}: cannot write in {json_summary.parent}: {err.strerror}", EXIT_USAGE)
    set_keys = {text.partition("=")[0].strip() for text in overrides}
    if resume_dir is None and name is None and "name" not in set_keys:
        name = time.strftime("run-%Y%m%d-%H%M%S")
    sets = list(overrides) + _shorthand_overrides(
        set_keys,
        env_name=env_name,
        trainer_kind=trainer_kind,
        max_steps=max_steps,
        inference_urls=inference_urls,
        name=None if resume_dir else name,
        runs_dir=None if resume_dir else runs_dir,
    )
    # Until the run installs its own handlers: SIGTERM as Ctrl-C, an exit with a message.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        if resume_dir is not None:
            if name is not None or runs_dir is not None:
                fail("--resume takes the run directory; do not combine it with --name/--runs-dir", EXIT_USAGE)
            run = resume_run(resume_dir, sets, config_file, drop_damaged)
            if run.resumed_from is None:
                click.echo(f"orch: starting {run.run_dir} (it stopped before its first event was committed)")
            else:
                click.echo(
                    f"orch: resuming {run.run_dir} from event {run.resumed_from} "
                    f"(step {run.state.step}, version {run.state.version})"
                )
        else:
            if drop_damaged:
                fail("--drop-damaged is for --resume RUN: a new run has nothing to drop", EXIT_USAGE)
            config = load_config(config_file, sets)
            run = create_run(config)
            click.echo(
                f"orch: run {run.run_dir} (env {', '.join(run.config.envs)}, trainer {run.config.trainer.kind}, "
                f"{run.config.max_steps} steps)"
            )
    except (ConfigError, RunDirError, LogError, FoldError, SinkUnavailable) as err:
        fail(str(err), EXIT_USAGE)  # refused before anything ran
    except KeyboardInterrupt:  # e.g. while a resume folds a long log: nothing was logged yet
        fail("interrupted before the run started; nothing was logged", EXIT_INTERRUPTED)
    progress = Progress(every=progress_every)
    progress.resumed_at(run.state)
    resume_hint = f"continue it with `orch run --resume {run.run_dir}` once fixed"
    try:
        with run.log, progress.live(run.config.max_steps, run.state.step - 1):
            orch = run_job(run, progress)
    except _run_errors() as err:
        fail(f"{str(err) or type(err).__name__} ({resume_hint})")
    except FinalizeError as err:
        traceback.print_exception(err.__cause__, file=sys.stderr)
        fail(f"{err} ({resume_hint})")
    except (KeyboardInterrupt, asyncio.CancelledError):
        fail("aborted (second interrupt); resume with `orch run --resume " + str(run.run_dir) + "`", EXIT_INTERRUPTED)
    summary = progress.summary(orch.state, run.run_dir)
    if json_summary:
        try:
            json_summary.write_bytes(orjson.dumps(summary, option=orjson.OPT_INDENT_2))
        except OSError as err:
            fail(f"cannot write --json-summary {json_summary}: {err.strerror}")
    state = orch.state
    if state.stop_reason == "interrupted":
        click.echo(f"orch: stopped on interrupt; resume with `orch run --resume {run.run_dir}`", err=True)
        sys.exit(EXIT_INTERRUPTED)
    if state.stop_reason == "zero_output":
        params = state.params
        fail(f"run stopped: zero_output: {orch.zero_output.cause(params.group_size, params.zero_output_batches)}")
    if state.stop_reason != "completed":
        cause = f" (the last failed episode: {orch.last_episode_error})" if orch.last_episode_error else ""
        fail(f"run stopped: {state.stop_reason}{cause}")


def _shorthand_overrides(set_keys: set[str], **flags) -> list[str]:
    """The `--set` equivalents of the shorthand flags given; a flag and a `--set` of the same key
    is a usage error (which should win is a guess)."""
    keys = {
        "env_name": ("--env", "envs"),
        "trainer_kind": ("--trainer", "trainer.kind"),
        "max_steps": ("--max-steps", "max_steps"),
        "inference_urls": ("--inference", "inference.openai.endpoints"),
        "name": ("--name", "name"),
        "runs_dir": ("--runs-dir", "runs_dir"),
    }
    sets = []
    for param, value in flags.items():
        if value is None:
            continue
        flag, key = keys[param]
        for other in set_keys:  # the same key, its section, or a key inside it
            if other == key or key.startswith(other + ".") or other.startswith(key + "."):
                fail(f"{flag} and --set {other}=... both set {key}: give one", EXIT_USAGE)
        if param == "env_name":
            value = {value: 1.0}
        elif param == "inference_urls":
            value = [url.strip() for url in value.split(",") if url.strip()]
            if not value:
                fail(f"--inference {flags['inference_urls']!r}: no endpoint URL", EXIT_USAGE)
        sets.append(f"{key}={orjson.dumps(str(value) if isinstance(value, Path) else value).decode()}")
    return sets


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _run_errors() -> tuple[type[BaseException], ...]:
    """What ends a run with one line, not a traceback: a failed component (trainer, inference
    backend, env server) or metric sink, or log, a batch file that cannot be written, a stall, a
    bounded wait that ran out (TimeoutError: weights never published, rollouts that would not
    stop; its message says what it waited for)."""
    from orchestrator.contracts import ComponentFailed
    from orchestrator.observe.sinks import SinkFailed
    from orchestrator.shell.loop import BatchWriteError, StalledError

    return (ComponentFailed, StalledError, BatchWriteError, LogError, TimeoutError, SinkFailed)


@main.command("trainer")
@click.option(
    "--run-dir",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="run directory holding trainer.json, batches/ and weights/",
)
@click.option(
    "--wait-for-start",
    "started_early",
    is_flag=True,
    help="import torch and transformers first, then wait for a start line on stdin before reading "
    "trainer.json (orch run starts its trainer so while it checks the model; end of input: exit 0)",
)
def trainer_command(run_dir: Path, started_early: bool) -> None:
    """The hf (transformers) trainer: batches/step_N.safetensors -> weights/step_N (+ STABLE)."""
    from orchestrator.hf.process import EXIT_OK, wait_for_start
    from orchestrator.hf.trainer import import_model_classes, run_trainer  # torch is imported only here
    from orchestrator.rundir import trainer_log

    if started_early:
        import_model_classes()
        if not wait_for_start(trainer_log(run_dir)):
            exit_process(EXIT_OK)
    exit_process(run_trainer(run_dir))


@main.command("tiny-model")
@click.argument("out_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--seed", type=int, default=0, show_default=True, help="initialisation and warm-start data")
@click.option(
    "--target-reward",
    type=click.FloatRange(0, 1),
    default=0.5,
    show_default=True,
    help="the supervised warm start stops at this sampled mean reward",
)
def tiny_model_command(out_dir: Path, seed: int, target_reward: float) -> None:
    """Build the tiny reverse_text model (a char-level Llama + tokenizer, with a supervised warm
    start) into OUT_DIR, an ordinary HF model dir; no download."""
    if out_dir.exists() and any(out_dir.iterdir()):
        fail(f"{out_dir} exists and is not empty; pick a new directory", EXIT_USAGE)
    from orchestrator.hf.tiny_model import build_tiny_model

    build_tiny_model(out_dir, seed=seed, target_reward=target_reward, log=click.echo)


@main.command("slurm", context_settings={"ignore_unknown_options": True})
@click.option("--inference-nodes", type=click.IntRange(min=1), default=1, show_default=True, help="nodes for vLLM")
@click.option(
    "--trainer-nodes", type=click.IntRange(min=1), default=1, show_default=True, help="torchrun nodes of the trainer"
)
@click.option("--one-node", is_flag=True, help="every server and torchrun node on one node (a test, a small run)")
@click.option(
    "--gpus-per-node", type=click.IntRange(min=0), default=0, show_default=True, help="#SBATCH --gpus-per-node"
)
@click.option("--job-name", default="orch", show_default=True)
@click.option("--log", "output", default="orch-%j.out", show_default=True, help="#SBATCH --output (%j: the job id)")
@click.option("--sbatch-arg", "sbatch_args", multiple=True, metavar="ARG", help="another #SBATCH line, repeatable")
@click.option(
    "-o", "--out", "out", type=click.Path(dir_okay=False, path_type=Path), help="write it here (default: stdout)"
)
@click.argument("run_args", nargs=-1, type=click.UNPROCESSED)
def slurm_command(
    inference_nodes, trainer_nodes, one_node, gpus_per_node, job_name, output, sbatch_args, out, run_args
) -> None:
    """The sbatch script of a run under SLURM; the run's own options (as `orch run` takes them)
    follow `--`, checked now (the config included), not once the job starts: e.g. `orch slurm
    --trainer-nodes 2 -o job.sh -- --config my.toml --name r1`."""
    from orchestrator.slurm_job import LAYOUT_KEYS, layout, sbatch_script

    try:
        options = run_command.make_context("orch run", list(run_args)).params
    except click.UsageError as err:
        fail(f"the run's options after --: {err.format_message()}")
    if any(o.split("=", 1)[0] in LAYOUT_KEYS for o in options["overrides"]):
        fail(f"{', '.join(LAYOUT_KEYS)} are orch slurm's own (its --inference-nodes, --trainer-nodes, --one-node)")
    nodes, serving, training = layout(inference_nodes, trainer_nodes, one_node)
    placed = ["placement=slurm", f"slurm.inference_nodes={serving}", f"slurm.trainer_nodes={training}"]
    if options["resume_dir"] is None:  # a resume's config is the run's own, checked when it resumes
        try:
            load_config(options["config_file"], [*options["overrides"], *placed])
        except ConfigError as err:
            fail(str(err))
    script = sbatch_script(
        nodes,
        [*run_args, *(arg for key in placed for arg in ("--set", key))],
        job_name=job_name,
        gpus_per_node=gpus_per_node,
        output=output,
        sbatch_args=list(sbatch_args),
        workdir=Path.cwd(),
    )
    if out is None:
        click.echo(script, nl=False)
        return
    try:
        out.write_text(script)
        out.chmod(0o755)
    except OSError as err:
        fail(f"cannot write {out}: {err.strerror or err}")
    click.echo(f"orch: wrote {out} ({nodes} node(s)); submit it with: sbatch {out}", err=True)


def _register_commands() -> None:
    from orchestrator.envs.cli import env_server_command
    from orchestrator.observe.cli import export_command, plot_command
    from orchestrator.serve.server import serve_command
    from replay.cli import replay_command

    main.add_command(env_server_command, "env-server")
    main.add_command(export_command, "export")
    main.add_command(plot_command, "plot")
    main.add_command(replay_command, "replay")
    main.add_command(serve_command, "serve")


_register_commands()


def entry() -> None:
    """The `orch` console script: `main`, then an exit without the interpreter's teardown
    (orchestrator.quick_exit). Not `main` itself: tests run it in-process."""
    try:
        main()
    except SystemExit as done:
        if done.code is not None and not isinstance(done.code, int):
            raise
        exit_process(done.code or 0)


if __name__ == "__main__":
    entry()
