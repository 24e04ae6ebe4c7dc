"""Where orch's servers and trainer run (orchestrator/placement.py) and `orch slurm`'s script: the
command lines and addresses the `slurm` placement gives, the one-line refusals before a run, and
the script. tests/slurm runs them on a real SLURM."""

from __future__ import annotations

import os
import shlex
import socket
import stat

import pytest

from orchestrator.config import load_config
from orchestrator.contracts import ConfigError
from orchestrator.placement import LOCAL, PlacementError, slurm_placement
from orchestrator.urls import free_port
from tests.support.cli import orch

HOST = socket.gethostname().split(".")[0]


@pytest.fixture
def srun_on_path(tmp_path, monkeypatch):
    """An `srun` found on PATH (never run here: only the placement's checks look for it)."""
    srun = tmp_path / "bin" / "srun"
    srun.parent.mkdir()
    srun.write_text("#!/bin/sh\nexit 1\n")
    srun.chmod(srun.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{srun.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "77")


def test_slurm_steps_name_their_node_and_share_the_allocation(srun_on_path):
    placement = slurm_placement(["a", "b", "c"], [0, 1], [2, 2], 29411, None)
    assert placement.server_host(0, "127.0.0.1") == "a" and placement.server_host(3, "127.0.0.1") == "b"
    assert placement.server_bind("127.0.0.1") == "0.0.0.0"
    step = placement.server_step(1, ["vllm", "serve"], {"CUDA_VISIBLE_DEVICES": "2,3"})
    assert step[:7] == [
        "srun",
        "--jobid=77",
        "--overlap",
        "--job-name=orch-vllm-1",
        "--nodes=1",
        "--ntasks=1",
        "--nodelist=b",
    ]
    assert step[-4:] == ["env", "CUDA_VISIBLE_DEVICES=2,3", "vllm", "serve"]  # after srun: the step's binding loses
    assert placement.server_step(0, ["vllm"], {})[-1:] == ["vllm"] and "env" not in placement.server_step(0, ["v"], {})
    trainer = placement.trainer_step(["torchrun"])
    assert "--nodes=1" in trainer and "--ntasks=2" in trainer and "--nodelist=c" in trainer
    assert placement.trainer_nodes == 2 and placement.rdzv_endpoint == "c:29411" and placement.trainer_host == "c"
    assert LOCAL.server_step(0, ["vllm"], {"CUDA_VISIBLE_DEVICES": "0"}) == ["vllm"] and LOCAL.rdzv_endpoint is None


def test_a_placement_slurm_cannot_make_is_one_line(srun_on_path, monkeypatch):
    with pytest.raises(PlacementError, match=r"^slurm.inference_nodes / slurm.trainer_nodes name node 2, but the "):
        slurm_placement(["a", "b"], [0], [2], 29411, None)
    with socket.socket() as taken:
        taken.bind((HOST, 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(PlacementError, match=rf"^slurm.rdzv_port {port} is in use on {HOST} "):
            slurm_placement([HOST], [0], [0, 0], port, None)
    monkeypatch.setenv("SLURM_GPUS_ON_NODE", "4")
    assert slurm_placement(["a", "b"], [0, 1], [0], 29411, None, ["0,1", "2,3", "3"]).server_host(2, "") == "a"
    with pytest.raises(
        PlacementError,
        match=r"^inference.openai.launch.gpus gives server 1 GPU 4 on node b, but the allocation has 4 GPU\(s\) "
        r"per node ",
    ):
        slurm_placement(["a", "b"], [0, 1], [0], 29411, None, ["0", "3,4"])
    with pytest.raises(PlacementError, match=r"puts two torchrun nodes on one node with GPUs, which would share them"):
        slurm_placement(["a"], [0], [0, 0], 29411, None)
    monkeypatch.delenv("SLURM_GPUS_ON_NODE")
    with pytest.raises(PlacementError, match="the allocation has 0 GPU"):
        slurm_placement(["a"], [0], [0], 29411, None, ["0"])
    monkeypatch.delenv("SLURM_JOB_ID")
    with pytest.raises(PlacementError, match=r"runs inside a SLURM allocation \(sbatch or salloc\): no SLURM_JOB_ID$"):
        slurm_placement(["a"], [0], [0], 29411, None)
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(PlacementError, match=r"^placement 'slurm' needs SLURM's srun on PATH \(none found\)$"):
        slurm_placement(["a"], [0], [0], 29411, "77")


def test_a_config_gives_its_placement_or_refuses_it_in_one_line(srun_on_path):
    layout = ["placement=slurm", f'slurm.nodes=["{HOST}"]', "slurm.trainer_nodes=[0, 0]"]
    placed = load_config(overrides=[*layout, f"slurm.rdzv_port={free_port(HOST)}"])
    assert placed.placement_of().trainer_nodes == 2
    with pytest.raises(ConfigError, match="lists its nodes unevenly"):
        load_config(overrides=["placement=slurm", "slurm.trainer_nodes=[0, 0, 1]"])
    outside = load_config(overrides=["placement=slurm", 'slurm.nodes=["a"]', "slurm.trainer_nodes=[1]"])
    with pytest.raises(ConfigError, match="the allocation has 1 node"):
        outside.placement_of()
    assert load_config().placement_of() is LOCAL


def test_orch_run_with_placement_slurm_outside_an_allocation_is_one_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["PATH"] = "/nonexistent" + os.pathsep + os.path.dirname(os.sys.executable)
    done = orch("run", "--runs-dir", str(tmp_path), "--set", "placement=slurm", env=env, timeout=120)
    assert done.returncode != 0
    assert done.stderr.strip().splitlines()[-1] == (
        "orch: error: placement 'slurm' needs SLURM's srun on PATH (none found)"
    )
    assert not (tmp_path / "default").exists()


def test_orch_slurm_writes_the_job_of_a_layout(tmp_path):
    script = tmp_path / "job.sh"
    done = orch(
        *["slurm", "--inference-nodes", "2", "--trainer-nodes", "3", "--gpus-per-node", "8", "-o", str(script)],
        *["--sbatch-arg=--time=01:00:00", "--", "--name", "r1", "--set", "rollout.group_size=4"],
    )
    assert done.returncode == 0, done.stderr
    lines = script.read_text().splitlines()
    assert lines[0] == "#!/bin/bash" and os.access(script, os.X_OK)
    assert {"#SBATCH --nodes=5", "#SBATCH --gpus-per-node=8", "#SBATCH --exclusive", "#SBATCH --time=01:00:00"} <= set(
        lines
    )
    run = shlex.split(lines[-1])
    assert run[0] == "exec" and run[2:5] == ["-m", "orchestrator.cli", "run"]
    assert run[5:9] == ["--name", "r1", "--set", "rollout.group_size=4"]
    assert run[9:] == [
        *["--set", "placement=slurm", "--set", "slurm.inference_nodes=[0, 1]", "--set", "slurm.trainer_nodes=[2, 3, 4]"]
    ]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--", "--bogus"], "the run's options after --: No such option '--bogus'."),
        (["--", "--set", "slurm.trainer_nodes=[1]"], "placement, slurm.inference_nodes, slurm.trainer_nodes are orch"),
        (["--", "--set", "rollout.group_size=0"], "invalid config: rollout.group_size: Input should be greater than"),
    ],
)
def test_orch_slurm_refuses_bad_input_in_one_line(args, message):
    done = orch("slurm", *args)
    assert done.returncode != 0 and done.stdout == ""
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(f"orch: error: {message}")


def test_the_layout_decides_the_trainers_nodes_and_a_bad_output_path_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"trainer.hf.nnodes and rdzv_endpoint are the slurm placement's to set"):
        load_config(overrides=["placement=slurm", "trainer.hf.nnodes=2", "trainer.hf.rdzv_endpoint=a:1"])
    with pytest.raises(ConfigError, match=r"slurm.trainer_nodes are indices into slurm.nodes: 0 or more"):
        load_config(overrides=["placement=slurm", "slurm.inference_nodes=[-1]"])
    done = orch("slurm", "-o", str(tmp_path / "missing" / "job.sh"))
    assert done.returncode != 0
    assert done.stderr.strip().splitlines() == [
        f"orch: error: cannot write {tmp_path}/missing/job.sh: No such file or directory"
    ]


def test_a_resume_may_change_the_placement_and_its_layout():
    """A run resumed in a new allocation (other nodes, another layout) continues."""
    from orchestrator.config import resumable

    assert all(resumable(key) for key in ("placement", "slurm.nodes", "slurm.inference_nodes", "slurm.trainer_nodes"))
