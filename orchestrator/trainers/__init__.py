"""Trainer components (the orchestrator's side of a trainer): `orchestrator.config.TRAINERS`.

* :mod:`.fake`     - `fake`: in-process; checks each shipped batch file, publishes its step.
* :mod:`.process`  - supervises a trainer process (`orch trainer`), or its ranks under torchrun
  (:mod:`.torchrun`); the `hf` trainer (orchestrator/hf/component.py) is one.

Each turns "the trainer finished step N" into one call of `publish(N)`, which the main loop
turns into a `version_published` input (rule 8: the version advances at confirmation).
"""

from orchestrator.contracts import ComponentFailed


class TrainerFailed(ComponentFailed):
    """The trainer died or stopped answering; the message says why, in one line."""
