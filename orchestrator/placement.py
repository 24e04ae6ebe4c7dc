"""Where the processes orch starts run (docs/scaling-out.md, "Under SLURM"): its vLLM servers and
its trainer. Chosen by name with the run's `placement`:

* ``local``: children of `orch run` on this machine (the default);
* ``slurm``: job steps (``srun``) of the SLURM allocation `orch run` runs in, on the nodes the
  `slurm` section names. Each step's ``srun`` is a local child of orch under the same guard as a
  local server, so everything orch stops, or orch's death, ends it: SLURM ends a step whose
  ``srun`` is gone.

A placement only rewrites command lines and addresses; the launcher, the trainer's supervision,
restarts and their events are the same for both."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from dataclasses import dataclass

SCONTROL_TIMEOUT_S = 30.0


class PlacementError(ValueError):
    """This machine cannot place the run's processes as asked (one line)."""


@dataclass(frozen=True)
class Placement:
    """``local``: processes are children of orch on this machine."""

    name = "local"

    def server_host(self, index: int, default: str) -> str:
        """The address server ``index`` is reached at (``default``: the launch's host)."""
        return default

    def server_bind(self, default: str) -> str:
        """The address a server binds."""
        return default

    def server_step(self, index: int, command: list[str], pinned: dict[str, str]) -> list[str]:
        """Server ``index``'s command line as this placement runs it; ``pinned``: environment
        variables it must see as given (its GPUs), which its own environment already holds here."""
        return command

    def trainer_step(self, command: list[str]) -> list[str]:
        """The trainer's torchrun command line as this placement runs it."""
        return command

    @property
    def trainer_nodes(self) -> int:
        """How many torchrun nodes the trainer has here (1: the section's own settings)."""
        return 1

    @property
    def rdzv_endpoint(self) -> str | None:
        return None

    @property
    def trainer_host(self) -> str | None:
        """An address of the trainer's first node that the servers reach (None: the trainer's own setting)."""
        return None


@dataclass(frozen=True)
class SlurmPlacement(Placement):
    """``slurm``: each server one step on its node, the trainer one step of a task per torchrun
    node, all with ``--overlap`` (they share the allocation's CPUs and memory with orch)."""

    job_id: str
    nodes: tuple[str, ...]
    inference_nodes: tuple[int, ...]
    trainer_node_indices: tuple[int, ...]
    rdzv_port: int

    name = "slurm"

    def _srun(self, job_name: str, nodes: list[str], tasks: int) -> list[str]:
        return [
            "srun",
            f"--jobid={self.job_id}",
            "--overlap",
            f"--job-name={job_name}",
            f"--nodes={len(nodes)}",
            f"--ntasks={tasks}",
            f"--nodelist={','.join(nodes)}",
            "--kill-on-bad-exit=1",
            "--export=ALL",
            "--quiet",
        ]

    def _server_node(self, index: int) -> str:
        return self.nodes[self.inference_nodes[index % len(self.inference_nodes)]]

    def server_host(self, index: int, default: str) -> str:
        return self._server_node(index)

    def server_bind(self, default: str) -> str:
        return "0.0.0.0"  # reached from the orchestrator's node by its name

    def server_step(self, index: int, command: list[str], pinned: dict[str, str]) -> list[str]:
        # set after srun: the step's own GPU binding would replace CUDA_VISIBLE_DEVICES otherwise
        settings = ["env", *(f"{name}={value}" for name, value in pinned.items())] if pinned else []
        return [*self._srun(f"orch-vllm-{index}", [self._server_node(index)], 1), *settings, *command]

    def trainer_step(self, command: list[str]) -> list[str]:
        nodes = list(dict.fromkeys(self.nodes[i] for i in self.trainer_node_indices))
        return [*self._srun("orch-trainer", nodes, len(self.trainer_node_indices)), *command]

    @property
    def trainer_nodes(self) -> int:
        return len(self.trainer_node_indices)

    @property
    def rdzv_endpoint(self) -> str:
        return f"{self.trainer_host}:{self.rdzv_port}"

    @property
    def trainer_host(self) -> str:
        return self.nodes[self.trainer_node_indices[0]]


LOCAL = Placement()


def slurm_placement(
    nodes: list[str],
    inference_nodes: list[int],
    trainer_nodes: list[int],
    rdzv_port: int,
    job_id: str | None,
    server_gpus: list[str] = (),
) -> SlurmPlacement:
    """The `slurm` placement of this allocation; PlacementError (one line) where orch is not in
    one it can place steps in: no srun, no job id, a layout that names more nodes than it has,
    servers given GPUs (``server_gpus``: each one's CUDA_VISIBLE_DEVICES) a node does not have."""
    if shutil.which("srun") is None:
        raise PlacementError("placement 'slurm' needs SLURM's srun on PATH (none found)")
    job_id = job_id or os.environ.get("SLURM_JOB_ID")
    if not job_id:
        raise PlacementError("placement 'slurm' runs inside a SLURM allocation (sbatch or salloc): no SLURM_JOB_ID")
    names = tuple(nodes) or allocation_nodes()
    wanted = max([*inference_nodes, *trainer_nodes])
    if wanted >= len(names):
        raise PlacementError(
            f"slurm.inference_nodes / slurm.trainer_nodes name node {wanted}, but the allocation has "
            f"{len(names)} node(s): {', '.join(names)}"
        )
    placement = SlurmPlacement(job_id, names, tuple(inference_nodes), tuple(trainer_nodes), rdzv_port)
    _check_gpus(placement, server_gpus)
    if placement.trainer_host in (socket.gethostname(), socket.gethostname().split(".")[0]):
        _check_port_free(placement.trainer_host, rdzv_port)
    return placement


def _check_gpus(placement: SlurmPlacement, server_gpus: list[str]) -> None:
    """PlacementError if a server is given a GPU its node does not have (each node has
    SLURM_GPUS_ON_NODE, none without it), or if two torchrun nodes share a node that has GPUs
    (each numbers its ranks' GPUs from 0: they would train on the same ones)."""
    on_node = int(os.environ.get("SLURM_GPUS_ON_NODE") or 0)
    shared = len(set(placement.trainer_node_indices)) < len(placement.trainer_node_indices)
    if on_node and shared:
        raise PlacementError(
            f"slurm.trainer_nodes {list(placement.trainer_node_indices)} puts two torchrun nodes on one node with "
            "GPUs, which would share them: one entry per node (trainer.hf.nproc ranks each)"
        )
    for index, devices in enumerate(server_gpus):
        ordinals = [int(device) for device in devices.split(",") if device.strip().isdigit()]  # not UUIDs
        highest = max(ordinals, default=-1)
        if highest >= on_node:
            raise PlacementError(
                f"inference.openai.launch.gpus gives server {index} GPU {highest} on node "
                f"{placement.server_host(index, '')}, but the allocation has {on_node} GPU(s) per node "
                "(SLURM_GPUS_ON_NODE; orch slurm --gpus-per-node asks for them)"
            )


def _check_port_free(host: str, port: int) -> None:
    """PlacementError if ``port`` is taken on this node (the trainer's rendezvous would fail
    after its step started)."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the rendezvous binds: TIME_WAIT is free
        try:
            probe.bind((host, port))
        except OSError as err:
            raise PlacementError(
                f"slurm.rdzv_port {port} is in use on {host} ({err.strerror}): pick another for the trainer's "
                "rendezvous"
            ) from None


def allocation_nodes() -> tuple[str, ...]:
    """SLURM_JOB_NODELIST's node names, in order (``scontrol show hostnames``)."""
    nodelist = os.environ.get("SLURM_JOB_NODELIST")
    if not nodelist:
        raise PlacementError("placement 'slurm': no SLURM_JOB_NODELIST (set slurm.nodes, or run inside an allocation)")
    try:
        shown = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist],
            capture_output=True,
            text=True,
            timeout=SCONTROL_TIMEOUT_S,
            check=True,
        )
    except (OSError, subprocess.SubprocessError) as err:
        what = f"scontrol could not expand SLURM_JOB_NODELIST {nodelist!r}"
        raise PlacementError(f"placement 'slurm': {what}: {err}") from None
    return tuple(shown.stdout.split())
