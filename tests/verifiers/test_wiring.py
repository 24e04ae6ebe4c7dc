"""The `verifiers` env as the registry wires it: its section, the parts a run is built of, and the
`openai` backend handing each request of an AgentEnv over with its client."""

from __future__ import annotations

import asyncio

import pytest

from orchestrator.config import load_config
from orchestrator.contracts import AgentEnv, InProcessEnv, RolloutRequest
from orchestrator.core.arrays import Tokens
from orchestrator.core.events import EpisodeCompleted
from orchestrator.envs.reverse_text import ReverseTextEnv
from orchestrator.inference.client import InferenceClient
from orchestrator.inference.endpoints_backend import EndpointsBackend
from tests.verifiers.util import EXAMPLES


class RecordingAgentEnv:
    """An AgentEnv that answers every episode with one sampled token, keeping what it was handed."""

    def __init__(self):
        self.handed: list[tuple[RolloutRequest, InferenceClient]] = []

    async def episode(self, request: RolloutRequest, client: InferenceClient) -> EpisodeCompleted:
        self.handed.append((request, client))
        return EpisodeCompleted(
            episode_id=request.episode_id,
            group_id=request.group_id,
            ok=True,
            temperature=1.0,
            reward=0.5,
            tokens=Tokens.of([1, 2], [0, 1], [0.0, -0.1]),
            policy_start=request.policy_version,
            policy_end=request.policy_version,
        )


def test_the_endpoints_backend_hands_an_agent_envs_episodes_over_with_its_client(tmp_path):
    agent = RecordingAgentEnv()
    assert isinstance(agent, AgentEnv) and not isinstance(InProcessEnv(ReverseTextEnv()), AgentEnv)

    async def main():
        async with InferenceClient(["http://127.0.0.1:9"], weight_sync="none") as client:
            backend = EndpointsBackend(
                tmp_path, {"agent": agent}, client, temperature=1.0, max_new_tokens=4, seed=0, load_timeout_s=5
            )
            backend._loaded.set()  # as after the first version's load
            return client, await backend(RolloutRequest(3, 1, "agent", 0, 0, 2))

    client, done = asyncio.run(main())
    ((request, handed),) = agent.handed
    assert handed is client and request.episode_id == 3
    assert (done.episode_id, done.policy_start, done.reward) == (3, 2, 0.5)


@pytest.mark.parametrize("example", ["verifiers_reverse_text.toml", "verifiers_reverse_text_two_turn.toml"])
def test_the_examples_select_the_openai_backend_and_the_hf_trainer(example):
    pytest.importorskip("verifiers.v1")
    config = load_config(EXAMPLES / example)
    assert set(config.envs) == {"verifiers"} and config.inference_kind() == "openai" and config.trainer.kind == "hf"
    assert "--enable-scale-out" in config.inference.openai.launch.extra_args
    assert config.env.verifiers.path == [str(EXAMPLES / "verifiers_tasksets")]  # stored absolute
