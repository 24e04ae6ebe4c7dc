"""Metric sinks (W&B, TensorBoard), fed from the run's committed log.

A sink is chosen by name (`SINKS`, the `metrics` config section of that name; a plugin's in
`metrics.plugins`, docs/plugins.md) and receives the rows of `observe.rows.StepRows`, so what it
shows is what the log holds. The run feeds the sinks
after each commit that completes rows (`SinkFeeder.feed`, on the effects side): the feeder reads
the newly committed events back from the log, folds them, and hands each sink the rows it has
not had yet. Which rows a sink has had is the seq of the last event whose rows it received, kept
in `RUN_DIR/sinks.json` per sink target: a resumed run folds the whole log again (the rows'
running figures need it) and writes only what lies beyond, so no step is written twice. (A crash
between a sink's write and that record repeats that one feed's rows.)
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import os
from collections.abc import Callable, Sequence
from itertools import groupby
from pathlib import Path
from typing import Protocol

import orjson

from eventlog import EventLog
from orchestrator.notices import one_line
from orchestrator.observe.rows import Row, StepRows, fold_events
from orchestrator.observe.samples import Completed, SampleText, Shipped, StepSamples
from orchestrator.plugins import resolve_sink
from orchestrator.rundir import atomic_write_bytes

CURSORS_FILE = "sinks.json"
CLOSE_TIMEOUT_S = 30.0  # the longest the end of a run waits for the sinks to finish writing


class SinkUnavailable(ValueError):
    """A sink the config asks for that cannot start here (its package is not installed, W&B online
    without credentials), found before the run dir exists; the message says what to do."""


class SinkFailed(RuntimeError):
    """A sink could not start (W&B online without a login, a log dir that is a file) or failed
    while writing; one-line message naming it."""


class Sink(Protocol):
    target: str  # what it writes to (a directory, a W&B run): the key of its record in sinks.json

    def write(self, rows: Sequence[Row], wall_time: float) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


class TextSink(Sink, Protocol):
    """A sink that also shows text: a few of each shipped step's samples (`observe.samples`)."""

    def write_samples(self, step: int, samples: Sequence[SampleText], wall_time: float) -> None: ...


SAMPLE_COLUMNS = ("sample", "reward", "prompt", "completion")


def sample_rows(samples: Sequence[SampleText]) -> list[list[str]]:
    """`samples` as table rows of text, in SAMPLE_COLUMNS order."""
    return [[str(s.sample_id), f"{s.reward:g}", s.prompt, s.completion] for s in samples]


class TensorBoardSink:
    """Scalars in a TensorBoard log dir (tensorboard's own writer: no torch, no TensorFlow),
    stamped with the log's time of the event that completed them."""

    package, extra = "tensorboard", "tensorboard"

    @staticmethod
    def check(section) -> None:
        """Nothing it needs is known before it starts (its log dir is made then)."""

    def __init__(self, section, run_dir: Path, identity: dict[str, str]):
        from tensorboard.summary import Writer
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        log_dir = Path(section.log_dir) if section.log_dir is not None else run_dir / "tensorboard"
        self.target = f"tensorboard:{log_dir.resolve()}"
        self.writer = Writer(str(log_dir))
        # tensorboard's framework-free Writer writes scalars only: text goes to a file of its own
        self.text_writer = EventFileWriter(str(log_dir), filename_suffix=".samples")

    def write(self, rows: Sequence[Row], wall_time: float) -> None:
        for step, name, value in rows:
            self.writer.add_scalar(name, value, step, wall_time=wall_time)

    def write_samples(self, step: int, samples: Sequence[SampleText], wall_time: float) -> None:
        """A table (its first row SAMPLE_COLUMNS) under the tag `samples`, in the text tab."""
        import numpy as np
        from tensorboard.compat.proto import event_pb2
        from tensorboard.plugins.text.summary_v2 import text_pb

        table = np.array([list(SAMPLE_COLUMNS), *sample_rows(samples)], dtype=object)
        self.text_writer.add_event(event_pb2.Event(wall_time=wall_time, step=step, summary=text_pb("samples", table)))

    def flush(self) -> None:
        self.writer.flush()
        self.text_writer.flush()

    def close(self) -> None:
        self.writer.close()
        self.text_writer.close()


class WandbSink:
    """A W&B run whose id is derived from the orch run's identity (its stored config hash), so a
    resumed orch run continues the same W&B run. Every row is logged against its orch step
    (`step`, the x axis of every chart), not W&B's own counter: a trainer's figures for step N
    arrive after batch N+1 may have shipped."""

    package, extra = "wandb", "wandb"

    @staticmethod
    def check(section) -> None:
        """Online (the mode set, else WANDB_MODE, else online) needs credentials, looked up the
        way wandb.init looks them up (WANDB_API_KEY, .netrc, its settings): without them wandb.init
        would fail once the run dir exists (or prompt), so SinkUnavailable now."""
        mode = section.mode or os.environ.get("WANDB_MODE") or "online"
        if mode in ("offline", "dryrun", "disabled"):
            return
        try:  # wandb's own lookup; it has no public API that finds credentials without a prompt
            from wandb.errors import AuthenticationError
            from wandb.sdk import wandb_setup
            from wandb.sdk.lib.wbauth.authenticate import _use_system_auth
            from wandb.sdk.lib.wbauth.host_url import HostUrl
        except Exception:  # noqa: BLE001 - a wandb layout we cannot read: the check is skipped (wandb.init says)
            return
        try:
            host = HostUrl(wandb_setup.singleton().settings.base_url)
            found = _use_system_auth(host=host, source="orch", update_session=False)
        except AuthenticationError as err:
            raise SinkUnavailable(f"metrics.wandb: its credentials are invalid: {one_line(err)}") from None
        except Exception:  # noqa: BLE001 - private APIs of a wandb layout we cannot read: the check is skipped
            return
        if found is None:
            raise SinkUnavailable(
                f"metrics.wandb logs online to {host} but finds no W&B API key: set WANDB_API_KEY or run "
                "`wandb login`, or log offline with --set metrics.wandb.mode=offline (`wandb sync` uploads it later)"
            )

    def __init__(self, section, run_dir: Path, identity: dict[str, str]):
        import wandb

        run_id = wandb_run_id(identity["config_hash"])
        self.target = f"wandb:{section.entity or ''}/{section.project}/{run_id}"
        self.run = wandb.init(
            project=section.project,
            entity=section.entity,
            name=section.name or identity["name"],
            id=run_id,
            resume="allow",
            mode=section.mode,
            dir=str(section.dir or os.environ.get("WANDB_DIR") or run_dir),
            config=orjson.loads(identity["config"]),
        )
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def write(self, rows: Sequence[Row], wall_time: float) -> None:
        for step, items in groupby(rows, key=lambda row: row[0]):
            self.run.log({"step": step, **{name: value for _, name, value in items}})

    def write_samples(self, step: int, samples: Sequence[SampleText], wall_time: float) -> None:
        """A table under the key `samples`, logged against the step."""
        import wandb

        self.run.log({"step": step, "samples": wandb.Table(columns=list(SAMPLE_COLUMNS), data=sample_rows(samples))})

    def flush(self) -> None:
        """wandb sends in the background; finish() waits for it."""

    def close(self) -> None:
        self.run.finish()


def wandb_run_id(config_hash: str) -> str:
    return "orch-" + hashlib.sha256(config_hash.encode()).hexdigest()[:16]


SINKS: dict[str, type] = {"tensorboard": TensorBoardSink, "wandb": WandbSink}


def configured_sinks(metrics) -> list[tuple[str, object]]:
    """(name, config section) of every sink the `metrics` config section turns on, in SINKS order,
    then the plugins' (name, settings) in their order (docs/plugins.md)."""
    builtin = [(name, getattr(metrics, name)) for name in SINKS if getattr(metrics, name) is not None]
    return builtin + list(metrics.plugins.items())


def sink_class(name: str) -> type:
    return SINKS[name] if name in SINKS else resolve_sink(name)


def check_sinks(metrics) -> None:
    """SinkUnavailable (one line: what to do) for a configured sink whose package is missing, or
    that cannot start here (W&B online without credentials)."""
    for name, section in configured_sinks(metrics):
        if name not in SINKS:
            continue  # a plugin: its module imported when the config was read
        cls = SINKS[name]
        if importlib.util.find_spec(cls.package) is None:
            raise SinkUnavailable(f"metrics.{name} needs the {cls.package} package: pip install 'orch[{cls.extra}]'")
        cls.check(section)


class SinkFeeder:
    """Feeds the configured sinks from the run's log (see the module docs)."""

    def __init__(self, db: Path, run_dir: Path, sinks: list[Sink], samples: StepSamples | None = None):
        self.reader = EventLog.open_reader(db)
        self.cursors_path = run_dir / CURSORS_FILE
        self.sinks = sinks
        self.rows = StepRows()
        self.samples = samples
        self.folded = 0  # the last seq folded into self.rows
        cursors = read_cursors(self.cursors_path)
        self.cursors = {sink.target: cursors.get(sink.target, 0) for sink in sinks}

    def catch_up(self, last_seq: int) -> None:
        """Fold the events up to `last_seq` and write the rows each sink has not had. Blocking."""
        if last_seq <= self.folded:
            return
        rows: list[tuple[int, float, Row]] = []
        for seq, ts, item in fold_events(self.reader, self._fold_items, self.folded + 1, last_seq):
            if isinstance(item, Completed):
                assert self.samples is not None  # only its fold items are not rows
                self.samples.completed(item.episode_id, seq)
            elif isinstance(item, Shipped):  # now: the next ship forgets where its samples are
                self._write_samples(seq, ts, item)
            else:
                rows.append((seq, ts, item))
        for seq, ts, group in _grouped(rows):
            for sink in self.sinks:
                if seq > self.cursors[sink.target]:
                    _guarded(sink, sink.write, group, ts)
        self.folded = last_seq
        for sink in self.sinks:
            _guarded(sink, sink.flush)
            self.cursors[sink.target] = max(self.cursors[sink.target], last_seq)
        try:
            atomic_write_bytes(self.cursors_path, orjson.dumps({**read_cursors(self.cursors_path), **self.cursors}))
        except OSError as err:
            raise SinkFailed(
                f"cannot record what the metric sinks have had in {self.cursors_path}: {err.strerror or err}"
            ) from err

    def _fold_items(self, ts: float, event) -> list:
        """What one event gives the sinks: its rows, and the samples' fold items."""
        rows: list = self.rows.feed(ts, event)
        if self.samples is None:
            return rows
        assert self.rows.state is not None  # feed folded the event into it
        return rows + self.samples.take(event, self.rows.state)

    def _write_samples(self, seq: int, ts: float, shipped: Shipped) -> None:
        """A shipped step's samples to each sink that shows text and has not had them."""
        assert self.samples is not None  # it gave `shipped`
        writers = [s for s in self.sinks if hasattr(s, "write_samples") and seq > self.cursors[s.target]]
        texts = self.samples.texts(self.reader, shipped) if writers else []
        for sink in writers if texts else ():  # none: the run has no tokenizer
            _guarded(sink, sink.write_samples, shipped.step, texts, ts)

    async def feed(self, last_seq: int) -> None:
        await asyncio.to_thread(self.catch_up, last_seq)

    async def aclose(self, last_seq: int, warn: Callable[[object], None], timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Write what is left and close every sink, waiting at most `timeout_s` (a W&B upload can
        be slow); past it, say so and go on (what was logged is in the log)."""
        try:
            await asyncio.wait_for(asyncio.to_thread(self._finish, last_seq), timeout_s)
        except TimeoutError:
            warn(f"the metric sinks were still writing {timeout_s:g}s after the run ended; left to finish on their own")
        except SinkFailed as err:  # the run's own outcome stands; what the sink missed is in the log
            warn(err)

    def _finish(self, last_seq: int) -> None:
        try:
            self.catch_up(last_seq)
        finally:
            failures = []
            for sink in self.sinks:  # every one is closed, whichever fails
                try:
                    _guarded(sink, sink.close)
                except SinkFailed as err:
                    failures.append(err)
            self.reader.close()
            if failures:
                raise failures[0]


def _guarded(sink, call, *args) -> None:
    """`call(*args)`; a sink's own error (a W&B upload, a full disk) as SinkFailed naming the sink.
    The run stops on it in one line and a resume writes what the sink missed."""
    try:
        call(*args)
    except Exception as err:  # noqa: BLE001 - any error of a third-party sink, reported in one line
        raise SinkFailed(f"metric sink {sink.target} failed: {type(err).__name__}: {one_line(err)}") from err


def _grouped(rows) -> list[tuple[int, float, list[Row]]]:
    """(seq, ts, rows) per event that completed rows."""
    return [
        (seq, ts, [row for _, _, row in items])
        for (seq, ts), items in groupby(rows, key=lambda item: (item[0], item[1]))
    ]


def read_cursors(path: Path) -> dict[str, int]:
    try:
        doc = orjson.loads(path.read_bytes())
    except (FileNotFoundError, orjson.JSONDecodeError):
        return {}
    return {k: v for k, v in doc.items() if isinstance(v, int)} if isinstance(doc, dict) else {}


def build_feeder(metrics, run_dir: Path, log: EventLog) -> SinkFeeder | None:
    """The feeder of the sinks the config turns on (None if none), for the run whose log is `log`:
    its identity (name, stored config and its hash) names the W&B run."""
    configured = configured_sinks(metrics)
    if not configured:
        return None
    meta = log.meta
    identity = {"name": run_dir.name, "config_hash": meta["config_hash"], "config": meta["config"]}
    sinks: list[Sink] = []
    try:
        for name, section in configured:
            try:
                sinks.append(sink_class(name)(section, run_dir, identity))
            except Exception as err:  # noqa: BLE001 - a third-party sink's errors have no common base
                where = f"metrics.{name}" if name in SINKS else f"metric sink {name!r}"
                raise SinkFailed(f"{where}: cannot start: {type(err).__name__}: {one_line(err)}") from err
        per_step = metrics.samples_per_step
        wanted = per_step > 0 and any(hasattr(sink, "write_samples") for sink in sinks)
        samples = StepSamples(per_step, run_dir, meta.get("config")) if wanted else None
        return SinkFeeder(Path(log.path), run_dir, sinks, samples)
    except BaseException:
        for sink in sinks:
            sink.close()
        raise
