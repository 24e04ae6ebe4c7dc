"""Rollout collection (``run_examples``) and the env server/client over HTTP.

``orchestrator.rollouts.env_server`` / ``env_client`` import starlette, uvicorn and httpx; they are
not imported here so that the collection API stays cheap to import.
"""

from orchestrator.rollouts.collect import ExampleFeed, Outcome, RolloutStream, run_examples

__all__ = ["ExampleFeed", "Outcome", "RolloutStream", "run_examples"]
