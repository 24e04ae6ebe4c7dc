"""`orch serve`: a small OpenAI-compatible completion server of orch's own (the endpoints of the
inference client's fast tests: docs/vllm.md says why they are not vLLM). Importing this package
imports nothing heavy; torch is loaded by the policy:

* :mod:`.server`    - the HTTP server: ``POST /v1/completions`` and ``/update_weights``.
* :mod:`.policy`    - its char-level torch policy: ``PolicyConfig``, ``build_policy``, sampling,
  ``token_logprobs``, its weight files.
* :mod:`.tokenizer` - that policy's char-level vocabulary and prompt/completion rendering (no torch).
"""
