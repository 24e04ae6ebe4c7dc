"""ProcessTrainer's failure line names this trainer process's own error, and how it ended."""

from __future__ import annotations

import asyncio
import os
import sys
import time

import pytest

from orchestrator.trainers import TrainerFailed
from orchestrator.trainers.process import ProcessTrainer


class ScriptTrainer(ProcessTrainer):
    """The supervision of `orch trainer`, around a one-line script instead."""

    def __init__(self, run_dir, script: str, max_restarts: int = 0):
        super().__init__(run_dir, max_restarts=max_restarts)
        self.script = script

    def command(self) -> list[str]:
        return [sys.executable, "-c", self.script]


def _failure(run_dir, script: str) -> str:
    trainer = ScriptTrainer(run_dir, script)
    asyncio.run(trainer.start())
    trainer.proc.wait(30)
    with pytest.raises(TrainerFailed) as failed:
        trainer.check()
    return str(failed.value)


def test_the_error_quoted_is_this_processs_not_an_earlier_ones(tmp_path):
    (tmp_path / "trainer.log").write_text("orch trainer: error: timed out waiting for step_3.json (an earlier run)\n")
    message = _failure(tmp_path, "import sys; print('orch trainer: error: bad batch 5'); sys.exit(3)")
    assert message == (
        "trainer exited with code 3; its last error line: orch trainer: error: bad batch 5 "
        f"(see {tmp_path / 'trainer.log'})"
    )


def test_a_trainer_killed_by_a_signal_says_so(tmp_path):
    (tmp_path / "trainer.log").write_text("trainer waiting for step_1.json (an earlier run)\n")
    message = _failure(tmp_path, "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    assert message.startswith("trainer was killed by signal SIGKILL; it wrote nothing to trainer.log")


def test_a_killed_trainers_last_metrics_line_is_not_quoted_as_its_error(tmp_path):
    script = "import os, signal; print('step 4 loss 0.31', flush=True); os.kill(os.getpid(), signal.SIGKILL)"
    message = _failure(tmp_path, script)
    assert message.startswith("trainer was killed by signal SIGKILL; it logged no error (see ")
    assert "loss" not in message


def test_a_traceback_s_last_line_is_the_error_quoted(tmp_path):
    message = _failure(tmp_path, "print('step 1 loss 0.5', flush=True); raise RuntimeError('CUDA went away')")
    assert message.startswith("trainer exited with code 1; its last error line: RuntimeError: CUDA went away")


def test_a_trainer_stopped_mid_write_leaves_no_temp_file(tmp_path):
    from orchestrator.rundir import ckpt_dir, weights_root

    for directory in (ckpt_dir(tmp_path), weights_root(tmp_path)):
        directory.mkdir()
    leftovers = [ckpt_dir(tmp_path) / ".ckpt.pt.tmp-123-abcd", weights_root(tmp_path) / ".step_3.tmp-123-abcd"]
    leftovers[0].write_bytes(b"x" * 1000)
    leftovers[1].mkdir()
    trainer = ScriptTrainer(tmp_path, "import time; time.sleep(60)")
    asyncio.run(trainer.start())
    asyncio.run(trainer.stop(0.0))
    assert trainer.proc.poll() is not None
    assert not any(path.exists() for path in leftovers)
    assert (ckpt_dir(tmp_path)).is_dir()


def test_a_trainer_config_that_cannot_be_written_is_a_trainer_failure(tmp_path):
    from orchestrator.config import load_config
    from orchestrator.contracts import PreparedModel
    from orchestrator.hf.factory import write_trainer_json
    from orchestrator.rundir import TRAINER_CONFIG_FILE

    (tmp_path / TRAINER_CONFIG_FILE).mkdir()  # in the way
    with pytest.raises(TrainerFailed, match=f"cannot write the trainer's config in {tmp_path}: "):
        config = load_config(None, [])
        ctx = config.build_context(tmp_path, version_now=lambda: 0)
        write_trainer_json(config.trainer.hf, ctx, PreparedModel(tmp_path / "model", ""))


@pytest.mark.parametrize(
    "overrides, transport",
    [
        ([], "gloo"),  # CPU servers: gloo, wherever the trainer runs
        (['inference.openai.launch.gpus=["0"]'], "nccl"),
        (["inference.openai.launch.servers=0", 'inference.openai.endpoints=["http://127.0.0.1:9"]'], "auto"),
    ],
)
def test_an_auto_push_transport_is_what_the_launched_servers_receive_over(tmp_path, overrides, transport):
    """The trainer's `auto` push transport is the launched servers' (decided by orch); with
    servers given by URL, orch does not know theirs and the trainer decides by its device."""
    from orchestrator.config import load_config
    from orchestrator.contracts import PreparedModel
    from orchestrator.hf.factory import write_trainer_json
    from orchestrator.hf.trainer import read_trainer_config

    push = ["inference.kind=openai", "inference.openai.launch.servers=1", "inference.openai.weight_sync=vllm_push"]
    config = load_config(None, push + overrides)
    ctx = config.build_context(tmp_path, version_now=lambda: 0)
    write_trainer_json(config.trainer.hf, ctx, PreparedModel(tmp_path / "model", ""))
    assert read_trainer_config(tmp_path).push.transport == transport


def test_a_killed_trainer_is_restarted_a_bounded_number_of_times_each_told(tmp_path):
    # Dies by SIGKILL the first two times (a marker file counts them), then stays up.
    script = (
        f"import os, signal, time, pathlib; p = pathlib.Path({str(tmp_path / 'runs.txt')!r});"
        " n = int(p.read_text()) if p.exists() else 0; p.write_text(str(n + 1));"
        " print('step 3 loss 0.2', flush=True); os.kill(os.getpid(), signal.SIGKILL) if n < 2 else time.sleep(60)"
    )
    trainer = ScriptTrainer(tmp_path, script, max_restarts=2)
    told = []
    trainer.report_restarts_to(lambda attempt, cause: told.append((attempt, cause)))
    asyncio.run(trainer.start())
    try:
        for _ in range(2):
            trainer.proc.wait(30)
            trainer.check()  # restarts it
        assert [a for a, _ in told] == [1, 2]
        assert told[0][1] == "trainer was killed by signal SIGKILL; it logged no error"
        time.sleep(1.0)
        trainer.check()  # the third process stays up
        assert trainer.proc.poll() is None
    finally:
        asyncio.run(trainer.stop(0.0))


def test_restarts_run_out_then_the_failure_names_them(tmp_path):
    trainer = ScriptTrainer(tmp_path, "import os, signal; os.kill(os.getpid(), signal.SIGKILL)", max_restarts=1)
    asyncio.run(trainer.start())
    trainer.proc.wait(30)
    trainer.check()
    trainer.proc.wait(30)
    with pytest.raises(TrainerFailed) as failed:
        trainer.check()
    assert str(failed.value).endswith(", after 1 restart(s))")
    assert trainer.restarts == 1


def test_a_trainer_that_refused_something_itself_is_not_restarted(tmp_path):
    trainer = ScriptTrainer(
        tmp_path, "import sys; print('orch trainer: error: bad batch 5'); sys.exit(3)", max_restarts=5
    )
    asyncio.run(trainer.start())
    trainer.proc.wait(30)
    with pytest.raises(TrainerFailed, match="bad batch 5"):
        trainer.check()
    assert trainer.restarts == 0


def test_a_run_refused_during_its_model_checks_kills_the_trainer_it_started_early(tmp_path, monkeypatch):
    """The hf trainer starts before the model is checked (its imports overlap the checks); a
    refusal or an interrupt meanwhile kills it, and nothing of the run is created."""
    from orchestrator.config import load_config
    from orchestrator.hf.component import HFTrainerConfig
    from orchestrator.shell import runner

    started = []
    start_early = HFTrainerConfig.start_early

    def recorded(self, run_dir):
        started.append(start_early(self, run_dir))
        return started[-1]

    monkeypatch.setattr(HFTrainerConfig, "start_early", recorded)

    def interrupted(config, stored_hash=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "preflight", interrupted)
    with pytest.raises(KeyboardInterrupt):
        runner.create_run(load_config(overrides=[f"runs_dir={tmp_path}", "name=r"]))
    [early] = started
    assert early.proc is None and not (tmp_path / "r").exists()
    assert not [line for line in _processes() if str(tmp_path / "r") in line]


def test_a_trainer_started_early_exits_by_itself_once_its_orchestrator_is_gone(tmp_path):
    """Its orchestrator gone (the pipe it waits on closed), it exits without training."""
    from orchestrator.trainers.process import EarlyTrainer

    early = EarlyTrainer(tmp_path / "r")
    early.proc.stdin.close()
    assert early.proc.wait(60) == 0
    assert not (tmp_path / "r").exists()


def _processes() -> list[str]:
    """Every process's command line."""
    lines = []
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                lines.append(f.read().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:
            continue
    return lines
