"""ProcessTrainer's failure line names this trainer process's own error, and how it ended."""

from __future__ import annotations

import asyncio
import sys

import pytest

from orchestrator.trainers import TrainerFailed
from orchestrator.trainers.process import ProcessTrainer


class ScriptTrainer(ProcessTrainer):
    """The supervision of `orch trainer`, around a one-line script instead."""

    def __init__(self, run_dir, script: str):
        super().__init__(run_dir)
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
    from orchestrator.hf.component import write_trainer_json
    from orchestrator.hf.model import PreparedModel
    from orchestrator.rundir import TRAINER_CONFIG_FILE

    (tmp_path / TRAINER_CONFIG_FILE).mkdir()  # in the way
    with pytest.raises(TrainerFailed, match=f"cannot write the trainer's config in {tmp_path}: "):
        write_trainer_json(load_config(None, []), tmp_path, PreparedModel(tmp_path / "model", ""))
