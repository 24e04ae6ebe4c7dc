"""Scale-out inference: OpenAI-compatible completion endpoints (vLLM, SGLang, or `orch serve`).

* :mod:`.protocol` - the wire format: request validation for `orch serve`, response parsing for
  any OpenAI-compatible server that returns token ids and per-token logprobs (no torch).
* :mod:`.client`   - :class:`~.client.InferenceClient`: several endpoints, least-loaded routing,
  per-group pinning, bounded retries, health tracking, the weight-update contract (no torch).
* :mod:`.endpoints_config` - inference backend `openai` (`inference.openai.*`): its config, checks
  and factory, and the endpoint URL rules (no httpx).
* :mod:`.endpoints_backend` - :class:`~.endpoints_backend.EndpointsBackend`: that backend, which
  samples through the client (an ``orchestrator.components.InferenceBackend``).
* :mod:`.server`   - `orch serve`: the embedded torch policy behind ``POST /v1/completions``.

The weight-update contract (docs/scaling-out.md; docs/rules.md rule 8): the trainer publishes
``RUN_DIR/weights/step_N`` then its ``STABLE`` marker; the orchestrator publishes version N at the
marker, then tells every endpoint to load that directory and waits for each confirmation
(``POST /update_weights {"path", "version"}`` -> ``{"version": N}``). Every completion reports the
version it was sampled with (``policy_version`` in the response), so episodes carry the truth.
"""
