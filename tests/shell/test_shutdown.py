"""Shutdown is bounded even when a rollout ignores its cancellation.

In a subprocess: before the fix the process never exited (asyncio.run waits for cancelled tasks
without a bound), so the test holds it to a timeout rather than hanging the suite."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent('''
    import asyncio, sys
    from eventlog import EventLog
    from orchestrator.config import load_config
    from orchestrator.core import events as ev
    from orchestrator.core.state import State
    from orchestrator.shell import loop, rollouts, runner

    loop.SHUTDOWN_STEP_S = runner.LEFTOVER_WAIT_S = 0.5
    fake = rollouts.FakeEnvRollouts.__call__

    async def stubborn(self, req):
        if req.episode_id < 20:
            return await fake(self, req)
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                pass  # ignores its cancellation

    rollouts.FakeEnvRollouts.__call__ = stubborn
    config = load_config(None, [f"runs_dir={sys.argv[1]}", "name=stuck", 'envs={"fake": 1.0}', "trainer.kind=fake",
                                "max_steps=4", "batch.size=8", "rollout.max_inflight=16", "trainer.publish_timeout_s=1"])
    config.run_dir.mkdir(parents=True)
    log = EventLog.create(config.run_dir / "events.db", durability="full")
    run = runner.OpenedRun(config, config.run_dir, log, State(), ev.RunStarted(params=config.core_params()), None)
    try:
        runner.run_job(run, None)
    except Exception as err:
        print(f"raised {type(err).__name__}: {err}")
''')


def test_a_rollout_that_ignores_cancellation_is_abandoned_and_the_runs_own_error_stands(tmp_path):
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    # The run stalled (every episode after the 20th hangs): that error, not the shutdown's, is raised.
    assert done.stdout.startswith("raised StalledError: no progress"), done.stdout
    warnings = done.stderr.splitlines()
    assert len(warnings) == 2, done.stderr
    assert re.fullmatch(r"orch: warning: rollout stream close: \d+ rollout task\(s\) still running 0\.5s after "
                        r"cancellation \(fn is ignoring CancelledError\?\)", warnings[0]), warnings[0]
    assert re.match(r"orch: warning: \d+ task\(s\) still running 0\.5s after cancellation at exit, abandoned: Task-",
                    warnings[1]), warnings[1]
