"""A version's way into 8 servers, on paper: the time from its STABLE to every server holding
it, by disk (`vllm_reload`: every server reads ``weights/step_N`` from the shared filesystem)
and by push (`vllm_push`: the trainer broadcasts it; orch opens one group per server, so the
trainer sends it once per server, all through its own network links). Bandwidths are
assumptions (`ASSUMED`), stated with every figure; the CPU measurements are in
bench/test_weight_push_bench.py.

Not modelled: the trainer's write of ``weights/step_N`` (both ways write it, before STABLE, for
resume and as the push's fallback), the engine's pause and resume (the same both ways), and
overlap between servers' reads beyond the filesystem's aggregate bandwidth."""

from __future__ import annotations

GB = 1e9

ASSUMED = {
    "servers": 8,
    "bytes_per_parameter": 2,  # bf16, as GPU servers hold them
    # A parallel filesystem's aggregate read bandwidth shared by the servers' reads (an NFS
    # server gives a tenth of it; a large Lustre or Weka system several times more).
    "shared_fs_read_GBps": 10.0,
    # What a broadcast moves out of the trainer's node, effectively: 8 x 400 Gb/s InfiniBand
    # links (400 GB/s of line rate), of which a broadcast across nodes reaches a fraction (NeMo
    # RL reports 0.74-1.0 s for Qwen3-30B). Within one node (NVLink) it is several times more.
    "trainer_egress_GBps": 100.0,
    # What one server's node takes in, effectively, shared with nothing else during a push.
    "server_ingress_GBps": 100.0,
}

PAPER_MODELS = {"7B": 7.6e9, "30B": 30.5e9}  # parameters (Qwen2.5-7B's, Qwen3-30B-A3B's)


def per_version_seconds(parameters: float, assumed: dict = ASSUMED) -> dict[str, float]:
    """Seconds from STABLE to every server holding the version: ``disk``, ``push`` (one group
    per server, orch's today) and ``push_one_group`` (one broadcast to all servers)."""
    size = parameters * assumed["bytes_per_parameter"]
    servers = assumed["servers"]
    egress, ingress = assumed["trainer_egress_GBps"] * GB, assumed["server_ingress_GBps"] * GB
    return {
        "disk": servers * size / (assumed["shared_fs_read_GBps"] * GB),
        "push": max(servers * size / egress, size / ingress),
        "push_one_group": size / min(egress, ingress),
    }
