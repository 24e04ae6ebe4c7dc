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
    assert message == f"trainer exited with code 3: orch trainer: error: bad batch 5 (see {tmp_path / 'trainer.log'})"


def test_a_trainer_killed_by_a_signal_says_so(tmp_path):
    (tmp_path / "trainer.log").write_text("trainer waiting for step_1.json (an earlier run)\n")
    message = _failure(tmp_path, "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    assert message.startswith("trainer was killed by SIGKILL: (it wrote nothing to trainer.log)")


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
