"""In-process inference (CPU). Importing this package imports nothing heavy; torch is loaded by
the submodule:

* :mod:`.sampler_backend` - the ``embedded`` inference backend: episodes sampled in this process
  from the run's HF model, off the event loop.

(`orch serve`'s own char-level policy, its tokenizer and server are :mod:`orchestrator.serve`.)
"""
