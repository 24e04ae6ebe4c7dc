"""Scale-out inference: OpenAI-compatible completion endpoints (vLLM, SGLang, or `orch serve`).

* :mod:`.protocol` - the wire format: request validation for `orch serve`, response parsing for
  any OpenAI-compatible server that returns token ids and per-token logprobs (no torch).
* :mod:`.client`   - :class:`~.client.InferenceClient`: several endpoints, least-loaded routing,
  per-group pinning, bounded retries, health tracking, the weight-update contract (no torch);
  its errors are :mod:`.errors`.
* :mod:`.weight_sync` - how an endpoint loads a version and what that means for its requests,
  one module per engine dialect (registered by name in ``DIALECTS``), each owning its endpoints'
  state and waits and saying what its engine, the config and launched servers need; the client
  and the checks ask them rather than name them.
* :mod:`.component` - inference backend `openai` (`inference.openai.*`): what it supports, its
  pre-run step and factory; its settings are :mod:`.endpoints_config` (no httpx).
* :mod:`.endpoints_backend` - :class:`~.endpoints_backend.EndpointsBackend`: that backend, which
  samples through the client (an ``orchestrator.contracts.InferenceBackend``).
* :mod:`.vllm_launch` - ``inference.openai.launch``: the vLLM servers a run starts and stops itself.

`orch serve` (the servers of the client's fast tests) is :mod:`orchestrator.serve`.

The weight-update contract (docs/scaling-out.md; docs/rules.md rule 8): the trainer publishes
``RUN_DIR/weights/step_N`` then its ``STABLE`` marker; the orchestrator publishes version N at the
marker, then tells every endpoint to load that directory (per ``inference.openai.weight_sync``: vLLM's
full reload or LoRA adapters, SGLang, `orch serve`) and waits for each confirmation. Every
completion reports the version it was sampled with, so episodes carry the truth.
"""
