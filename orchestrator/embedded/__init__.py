"""The embedded real job's torch parts (CPU): tokenizer, policy + sampler, trainer process, simulation.

Importing this package imports nothing heavy; torch is loaded by the submodules:

* :mod:`.tokenizer` - char-level vocabulary and prompt/completion rendering (no torch).
* :mod:`.defaults`  - recommended settings (group size, batch, lr, steps...; no torch).
* :mod:`.files`     - run-directory paths and atomic batch/weight file contracts (no torch).
* :mod:`.policy`    - ``PolicyConfig``, ``build_policy``, ``sample_group(s)``, ``token_logprobs``,
  ``save_weights``/``load_policy``, the thread-safe ``EmbeddedSampler``.
* :mod:`.trainer`   - ``TrainerConfig``/``DEFAULT_TRAINER_CONFIG``, ``run_trainer``, ``trainer_command``.
* :mod:`.simulate`  - a synchronous stand-in for the orchestrator used to tune and test learning.
"""
