"""The `verifiers` env: a verifiers (v1) taskset's episodes, played by verifiers, their model calls
through the `openai` backend's inference client (docs/verifiers.md).

* :mod:`.component`: the env component (`env.verifiers.*`): what it supports, its factory;
* :mod:`.config`: its settings and the checks made of the taskset before a run (light: verifiers
  is imported by the checks and the factory only);
* :mod:`.env`: the env the backend hands each episode to (one `run_slot` per orch episode);
* :mod:`.adapter`: verifiers' model calls routed through the inference client, and the one
  renderers/vLLM answer shape that needs adapting.

A package of its own: it builds on the envs' contracts and the inference client's errors.
"""
