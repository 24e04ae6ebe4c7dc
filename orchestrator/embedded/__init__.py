"""In-process inference (CPU). Importing this package imports nothing heavy; torch is loaded by
the submodules:

* :mod:`.sampler_backend` - the ``embedded`` inference backend: episodes sampled in this process
  from the run's HF model, off the event loop.
* :mod:`.policy`    - ``orch serve``'s own char-level policy: ``PolicyConfig``, ``build_policy``,
  sampling, ``token_logprobs``, its weight files.
* :mod:`.tokenizer` - that policy's char-level vocabulary and prompt/completion rendering (no torch).
"""
