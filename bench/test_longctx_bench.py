"""Long contexts: bytes per token held in memory and in the log, the commit of large
traces against a raw write + fsync of the same bytes, and the cold fold of such a log.

    .venv/bin/python -m pytest bench/test_longctx_bench.py -o addopts= --benchmark-only -s

One measurement runs in a fresh subprocess (its RSS is the figure): the fake env makes
`ORCH_LONGCTX_TRACES` traces (default 1,024) of a 1,024-token prompt and a 16k-token completion,
as that many one-sample episodes, then as a quarter as many episodes of 4 samples each,
token ids from a 151,936-token vocabulary, and the core holds them all (a batch larger than the
run, so nothing ships): RAM per held token = RSS growth / tokens held. Every event is appended to a
log with durability=full, committed whenever ~64 MB of trace bytes are buffered; each commit is
timed, then a raw write + fsync of the same bytes (the rows' data and payloads) in the same
directory. The log's bytes are its file, WAL and side files (`<log>.payloads/`, where payloads
over 100 KiB go). The log is then folded cold; the folded state must equal the live one (the invariant
this fails on). Figures only otherwise: a slow disk or a busy machine is no failure.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TRACES = int(os.environ.get("ORCH_LONGCTX_TRACES", 1024))
PROMPT_TOKENS, COMPLETION_TOKENS = 1024, 16_384
COMMIT_BYTES = 64 << 20


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(run_dir: Path, n_traces: int, prompt_tokens: int, completion_tokens: int, samples: int = 1) -> dict:
    """Run in a fresh interpreter: see the module doc. `samples` per episode: `n_traces` samples
    in all, each its own prompt and completion (docs/rules.md, "Samples")."""
    import asyncio
    import gc
    import statistics
    import time

    from eventlog import EventLog
    from eventlog.sidefiles import side_dir
    from orchestrator.contracts import RolloutRequest
    from orchestrator.core import events as ev
    from orchestrator.core.decide import decide
    from orchestrator.core.state import initial_state, state_hash
    from orchestrator.envs.fake import FakeEnvConfig
    from orchestrator.fold import fold_log
    from orchestrator.inference.fake import FakeEpisodes

    n_episodes = n_traces // samples
    params = ev.CoreParams(
        env_ratios={"fake": 1.0},
        group_size=8,
        batch_size=2 * n_traces,  # nothing ships: every trace stays held
        max_inflight=n_episodes,
        max_steps=1,
        zero_output_batches=10**6,
    )
    env = FakeEpisodes(
        FakeEnvConfig(
            prompt_tokens=prompt_tokens,
            min_tokens=completion_tokens,
            max_tokens=completion_tokens,
            samples_per_episode=samples,
        ),
        seed=0,
        version_now=lambda: 0,
    )
    state = initial_state(params)
    gc.collect()
    rss_before = _rss_bytes()

    log = EventLog.create(run_dir / "events.db", durability="full")
    commits: list[tuple[float, float, int]] = []  # (commit s, raw write + fsync s, bytes)
    buffered: list[bytes] = []

    def commit() -> None:
        started = time.perf_counter()
        log.commit()
        commit_s = time.perf_counter() - started
        raw = b"".join(buffered)
        started = time.perf_counter()
        with open(run_dir / "raw.bin", "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        raw_s = time.perf_counter() - started
        os.unlink(run_dir / "raw.bin")
        commits.append((commit_s, raw_s, len(raw)))
        buffered.clear()

    def append(event) -> None:
        row = ev.encode_event(event)
        log.append_json(*row)
        buffered.extend(part for part in row[1:] if part)

    # The first n_episodes episodes complete (the ones dispatched after them stay in flight).
    tasks: dict[int, tuple[str, int]] = {}  # group id -> (env, task id)
    inputs, completions = [ev.RunStarted(params=params)], 0
    while inputs:
        event = inputs.pop(0)
        append(event)
        for decision in decide(state, event):
            append(decision)
            if decision.kind == "group_dispatched":
                tasks[decision.group_id] = (decision.env, decision.task_id)
            elif decision.kind == "episode_dispatched" and completions < n_episodes:
                completions += 1
                env_name, task_id = tasks[decision.group_id]
                req = RolloutRequest(decision.episode_id, decision.group_id, env_name, task_id, decision.attempt, 0)
                inputs.append(asyncio.run(env(req)))
        if sum(map(len, buffered)) >= COMMIT_BYTES:
            commit()
    if log.pending:
        commit()
    log.close()
    gc.collect()
    held = state.pending_tokens + sum(state.traces[t].n_tokens for g in state.groups.values() for t in g.members)
    rss_growth = _rss_bytes() - rss_before
    log_bytes = sum(p.stat().st_size for p in run_dir.glob("events.db*") if p.is_file())
    log_bytes += sum(p.stat().st_size for p in Path(side_dir(str(run_dir / "events.db"))).glob("*"))

    started = time.perf_counter()
    with EventLog.open_reader(run_dir / "events.db") as reader:
        folded = fold_log(reader, use_snapshots=False)
    fold_s = time.perf_counter() - started
    big = [c for c in commits if c[2] >= COMMIT_BYTES // 2]
    return {
        "traces_held": len(state.traces),
        "tokens_held": held,
        "rss_growth_bytes": rss_growth,
        "ram_bytes_per_token": round(rss_growth / held, 2),
        "log_bytes": log_bytes,
        "log_bytes_per_token": round(log_bytes / held, 2),
        "commits": len(commits),
        "commit_mb": round(statistics.median(c[2] for c in big) / 2**20, 1) if big else None,
        "commit_s": round(statistics.median(c[0] for c in big), 3) if big else None,
        "raw_write_fsync_s": round(statistics.median(c[1] for c in big), 3) if big else None,
        "commit_vs_raw": round(statistics.median(c[0] / c[1] for c in big), 2) if big else None,
        "cold_fold_s": round(fold_s, 3),
        "fold_equals_live": folded.state is not None and state_hash(folded.state) == state_hash(state),
    }


@pytest.mark.benchmark(group="longctx")
@pytest.mark.parametrize("samples", [1, 4])
def test_long_context_traces(benchmark, tmp_path, samples):
    """`samples` 4: the same traces as samples of a quarter as many episodes (the log's bytes per
    token should not change with how the tokens are grouped)."""
    script = (
        "import json, sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]);"
        "from bench.test_longctx_bench import measure;"
        "print(json.dumps(measure(Path(sys.argv[2]), *map(int, sys.argv[3:]))))"
    )
    args = [str(ROOT), str(tmp_path), str(TRACES), str(PROMPT_TOKENS), str(COMPLETION_TOKENS), str(samples)]

    def run() -> dict:
        shutil.rmtree(tmp_path)
        tmp_path.mkdir()
        out = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=1800)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    figures = benchmark.pedantic(run, rounds=1, iterations=1)
    benchmark.extra_info.update(figures)
    shape = f"{TRACES} traces of {PROMPT_TOKENS} + {COMPLETION_TOKENS} tokens, {samples} per episode"
    print(f"\nlong contexts ({shape}): {figures}")
    assert figures["traces_held"] == TRACES
    assert figures["fold_equals_live"], "the cold fold of the log does not rebuild the live state"
