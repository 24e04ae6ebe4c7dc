"""The `verifiers` env: a verifiers (v1) taskset's episodes, played by verifiers, their model calls
through the `openai` backend's inference client (docs/verifiers.md).

* :mod:`.config`: the env component (`env.verifiers.*`) and the checks made before a run (light:
  verifiers is imported by the checks and the factory only);
* :mod:`.env`: the env the backend hands each episode to (one `run_slot` per orch episode);
* :mod:`.adapter`: verifiers' model calls routed through the inference client, and the one
  renderers/vLLM answer shape that needs adapting.

A package of its own: it builds on both the envs and the inference layer (which imports the envs).
"""
