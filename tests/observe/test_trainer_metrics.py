"""Trainer metrics: the metrics.json contract, the trainers that report them, the event that carries them."""

from __future__ import annotations

import asyncio
import itertools

import orjson
import pytest

from orchestrator import rundir as files
from orchestrator.core import events as ev
from orchestrator.core.batch import batch_sha256
from orchestrator.trainers.fake import FakeTrainer
from orchestrator.trainers.process import ProcessTrainer
from tests.support.batches import write_batch_file


def _batch(run_dir, step, masks):
    samples = [
        {"sample_id": i, "mask": mask, "token_ids": [1] * len(mask), "logprobs": [0.0] * len(mask)}
        | {"advantage": 1.0, "temperature": 1.0}
        for i, mask in enumerate(masks)
    ]
    return batch_sha256(write_batch_file(run_dir, step, samples).read_bytes())


def test_fake_trainer_reports_the_batch_it_read_and_its_step_time(tmp_path):
    published = []
    ticks = itertools.count(step=0.25)  # each reading of the clock is 0.25 s later
    trainer = FakeTrainer(tmp_path, 0.0, clock=lambda: next(ticks))

    async def main():
        task = asyncio.create_task(trainer.run(0, lambda v, m: published.append((v, m))))
        trainer.batch_written(1, _batch(tmp_path, 1, [[0, 1, 1], [0, 0, 1, 1, 1]]))
        trainer.batch_written(2, _batch(tmp_path, 2, []))
        async with asyncio.timeout(10):
            while len(published) < 2:
                await asyncio.sleep(0.01)
        task.cancel()

    asyncio.run(main())
    assert published == [
        (1, {"samples": 2, "tokens": 5, "step_time_s": 0.25}),
        (2, {"samples": 0, "tokens": 0, "step_time_s": 0.25}),
    ]


def _publish_weights(run_dir, version, metrics_bytes=None):
    wdir = files.weights_dir(run_dir, version)
    wdir.mkdir(parents=True)
    if metrics_bytes is not None:
        (wdir / files.METRICS_FILE).write_bytes(metrics_bytes)
    files.mark_stable(wdir)


@pytest.mark.parametrize(
    "written, logged, warning",
    [
        (b'{"loss": 0.5, "tokens": 12}', {"loss": 0.5, "tokens": 12}, None),
        (None, None, None),  # a trainer that reports nothing (a warm start)
        (
            b'{"loss": NaN, "grad_norm": 1.5, "note": "x", "flag": true}',
            {"grad_norm": 1.5},
            "non-finite or non-numeric loss, note, flag",
        ),
        (b"[1, 2]", None, "is not a JSON object"),
        (b'{"loss": 1e999}', {}, "non-finite or non-numeric loss"),
    ],
)
def test_process_trainer_publishes_the_metrics_beside_the_marker(tmp_path, capsys, written, logged, warning):
    published = []
    watcher = ProcessTrainer(tmp_path, poll_s=0.01)
    _publish_weights(tmp_path, 1, written)

    async def main():
        task = asyncio.create_task(watcher.run(0, lambda v, m: published.append((v, m))))
        async with asyncio.timeout(10):
            while not published:
                await asyncio.sleep(0.01)
        task.cancel()

    asyncio.run(main())
    assert published == [(1, logged)]
    err = capsys.readouterr().err
    assert (warning in err) if warning else err == ""


def test_process_trainer_publishes_every_version_marked_between_two_polls_in_order(tmp_path):
    """A restarted trainer may train two batches (already on disk) within one poll: each version
    is published, with its own metrics, none skipped for the newest."""
    published = []
    watcher = ProcessTrainer(tmp_path, poll_s=0.01)
    for version in (1, 2, 3):
        _publish_weights(tmp_path, version, b'{"loss": %d}' % version)

    async def main():
        task = asyncio.create_task(watcher.run(0, lambda v, m: published.append((v, m))))
        async with asyncio.timeout(10):
            while len(published) < 3:
                await asyncio.sleep(0.01)
        task.cancel()

    asyncio.run(main())
    assert published == [(1, {"loss": 1}), (2, {"loss": 2}), (3, {"loss": 3})]


def test_version_published_carries_metrics_through_its_row():
    metrics = {"loss": 0.25, "tokens": 7}
    validated = ev.checked(ev.VersionPublished, version=3, metrics=metrics)
    built = ev.VersionPublished(version=3, metrics=metrics)
    assert built == validated and ev.encode_event(built) == ev.encode_event(validated)
    kind, data, _ = ev.encode_event(validated)
    assert data == b'{"version":3,"metrics":{"loss":0.25,"tokens":7}}'
    assert ev.decode_event(kind, data) == validated
    assert ev.VersionPublished(version=1).metrics is None  # default: nothing reported
    assert ev.encode_event(ev.VersionPublished(version=1))[1] == b'{"version":1}'
    with pytest.raises(ValueError, match="version_published.metrics.loss is nan: it must be finite"):
        ev.checked(ev.VersionPublished, version=1, metrics={"loss": float("nan")})


def test_replay_diff_does_not_compare_the_trainers_measurements():
    from replay.diff import normalize

    kind, data, _ = ev.encode_event(ev.VersionPublished(version=2, metrics={"step_time_s": 0.031}))
    assert normalize(orjson.loads(data)) == normalize(orjson.loads(b'{"version": 2}')) == {"version": 2}
