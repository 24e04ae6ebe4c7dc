"""The sbatch script of a run under SLURM, as `orch slurm` writes it (docs/scaling-out.md, "Under
SLURM"): it asks for the layout's nodes and runs `orch run` on the first of them with the `slurm`
placement (orchestrator/placement.py): each vLLM server a job step on an inference node, the
trainer one step of a task per torchrun node on the trainer nodes."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

LAYOUT_KEYS = ("placement", "slurm.inference_nodes", "slurm.trainer_nodes")


def layout(inference_nodes: int, trainer_nodes: int, one_node: bool) -> tuple[int, list[int], list[int]]:
    """(nodes to ask for, the inference nodes' indices, the trainer nodes' indices): apart, the
    inference nodes first; with ``one_node``, every server and every torchrun node on node 0."""
    if one_node:
        return 1, [0], [0] * trainer_nodes
    return (
        inference_nodes + trainer_nodes,
        list(range(inference_nodes)),
        list(range(inference_nodes, inference_nodes + trainer_nodes)),
    )


def sbatch_script(
    nodes: int,
    run_args: list[str],
    *,
    job_name: str,
    gpus_per_node: int,
    output: str,
    sbatch_args: list[str],
    workdir: Path,
) -> str:
    """The script: `#SBATCH` lines, then `orch run RUN_ARGS` from ``workdir`` with this Python."""
    lines = [
        "#!/bin/bash",
        f"# written by: orch slurm ({nodes} node(s)); submit it with sbatch",
        f"#SBATCH --job-name={job_name}",
        f"#SBATCH --nodes={nodes}",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --exclusive",  # the steps share each node's CPUs (and GPUs) with --overlap: all of them
        f"#SBATCH --output={output}",
    ]
    if gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={gpus_per_node}")
    lines += [f"#SBATCH {arg}" for arg in sbatch_args]
    run = shlex.join([sys.executable, "-m", "orchestrator.cli", "run", *run_args])
    lines += ["set -euo pipefail", f"cd {shlex.quote(str(workdir))}", f"exec {run}", ""]
    return "\n".join(lines)
