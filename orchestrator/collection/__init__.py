"""Rollout collection: ``run_examples`` runs a worker over a feed of examples, with bounded
cancellation and drain (``aclose`` / ``aclose_and_drain``); ``testing`` holds seeded workloads."""

from orchestrator.collection.collect import ExampleFeed, Outcome, RolloutStream, run_examples

__all__ = ["ExampleFeed", "Outcome", "RolloutStream", "run_examples"]
