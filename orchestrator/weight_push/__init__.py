"""Weight push: the trainer process broadcasts each version's tensors into vLLM servers over a
process group, instead of every server reading ``weights/step_N`` from disk
(`inference.openai.weight_sync = "vllm_push"`; docs/vllm.md, "Weight push").

* :mod:`.buckets`: the wire format, named tensors packed into byte buckets cut the same way on
  both sides from (name, dtype, shape) alone (bf16, fp32, any dtype);
* :mod:`.comm`: the communicator interface and its gloo form (a stateless group per server);
* :mod:`.transport`, :mod:`.nccl`: what moves a version, chosen by name: gloo between CPU
  processes (orch's ``orch_gloo`` engine on the servers), NCCL between GPUs (vLLM's own ``nccl``
  engine on the servers, the trainer's side made with vLLM's helpers);
* :mod:`.sender`: the trainer's side, the newest version's tensors, a channel per server and the
  small HTTP service through which the orchestrator asks for a push;
* :mod:`.vllm_engine`, :mod:`.vllm_plugin`: vLLM's side, a weight-transfer engine (``orch_gloo``)
  registered by orch's ``vllm.general_plugins`` entry point, which each worker runs.

The control plane. Three parties: the orchestrator (its client's `vllm_push` dialect), each
vLLM server (its dev-mode routes, its workers' weight-transfer engine) and the trainer process
(its push service). The orchestrator drives; the trainer and the servers only answer. Why: the
client already owns each server's pause and resume and the version each completion records,
and the two ends of a broadcast must enter it together, which only the party that talks to
both can arrange.

1. Trainer, at each publish (once STABLE is written): ``WeightPushSender.set_version(V, tensors)``
   (a copy: training goes on; published versions only, so a push never gets ahead of the log).
   Its ``PushService`` listens on a free port; ``RUN_DIR/weights/push.json`` says where, and
   which instance (a restarted trainer is a new one).
2. Orchestrator, per endpoint and version (the dialect's load, one at a time per endpoint):
   a. drain (update_mode wait: its requests end; interrupt: aborted and continued) and ``POST
      /pause``, as `vllm_reload`;
   b. once per (server, trainer instance): ``GET /get_world_size`` (W workers) -> trainer ``POST
      /channel {key, world_size: 1+W}`` (the trainer's store listens; the trainer's rank-0
      rendezvous runs in the channel's thread) -> server ``POST /shutdown_weight_transfer_engine``
      (the group it held) and ``POST /init_weight_transfer_engine`` (each worker joins as rank
      1..W; returns once the group formed);
   c. once per trainer instance, trainer ``GET /metadata`` (names, dtypes, shapes); then server
      ``POST /start_weight_update``;
   d. at once: server ``POST /update_weights`` (workers receive bucket after bucket) and trainer
      ``POST /push {key, version: V}`` (broadcasts its newest version, V or newer, answers the
      version sent); both awaited, neither left running;
   e. server ``POST /finish_weight_update {weight_version}``, ``/reset_prefix_cache``, ``/resume``;
      the endpoint holds the version sent.

Failures. A push that fails (the trainer gone before or during it, a group that timed out) is
replaced by a reload of ``weights/step_N`` on the still paused server: no server serves a
version it got part of.

Bounds. Every HTTP call has the load timeout (``inference.openai`` load timeout: the run's
publish timeout). Every collective, the rendezvous included, gives up after the group's timeout
(``timeout_s`` of the sender, 60 s by default, shorter than the load timeout, so that a side left
alone gives up before the other side's HTTP call does and no collective outlives the load that
started it); NCCL's have no timeout of their own and are bounded by the trainer's wait alone.
On the trainer, a whole push runs in the channel's thread and the request waits for it for at
most ``push_timeout_s``; past it the group is aborted. A failed push drops the channel on both
sides: the next load joins a fresh group. A collective cannot be cancelled from outside, so the group's timeout is
what ends a worker's receive whose trainer died; until then that server's engine core is busy in
its ``/update_weights``.

One group per server, not one for all: orch loads each endpoint on its own (a slow or restarted
server does not hold the others, and a failure stays in its group), at the cost of the trainer
sending each version once per server (bench/weight_transfer_paper.py puts a figure on it)."""

PUSH_INFO = "push.json"  # in RUN_DIR/weights: where the trainer's push service listens, and which instance
GLOO_BACKEND = "orch_gloo"  # the servers' weight-transfer backend for the gloo transport (vllm_plugin)
NCCL_BACKEND = "nccl"  # ... for the NCCL transport: vLLM's own
WIRE_ITEMSIZE = {"float32": 4, "bfloat16": 2}  # bytes per element of each dtype a push may travel in
