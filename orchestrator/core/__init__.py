"""The pure core: the event catalogue, the state, `evolve` (the reducer) and `decide` (the rules)."""

# Gives every event class its `unvalidated` constructor, whichever core module is imported first.
from orchestrator.core import _fast_events as _fast_events  # noqa: F401
from orchestrator.core._fast_events import decode_unvalidated as decode_unvalidated
