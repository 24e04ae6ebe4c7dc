"""The verifiers adapter without a model server: the renderers/vLLM logprob shape (on a response
recorded from vLLM 0.32's /inference/v1/generate), the routing of generate calls through orch's
inference client, the task draw, and the config checks made before a run."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import orjson
import pytest

pytest.importorskip("verifiers.v1")

from renderers.client import MalformedGenerateResponseError, _parse_completion_logprobs  # noqa: E402

from orchestrator.config import ConfigError, load_config  # noqa: E402
from orchestrator.envs.draw import task_index  # noqa: E402
from orchestrator.inference.client import InferenceClient  # noqa: E402
from orchestrator.verifiers import adapter  # noqa: E402
from tests.support.cli import orch  # noqa: E402
from tests.support.runs import sets  # noqa: E402
from tests.verifiers.util import orch_env  # noqa: E402

RECORDED = Path(__file__).parent / "data" / "vllm032_generate.json"
TASKSETS = Path(__file__).parent / "tasksets"
EXAMPLES = Path(__file__).parents[2] / "examples" / "verifiers_tasksets"


def recorded() -> dict:
    return json.loads(RECORDED.read_text())


def test_recorded_vllm_answer_fails_renderers_unadapted():
    (choice,) = recorded()["choices"]
    with pytest.raises(MalformedGenerateResponseError, match="token must be 'token_id:260'"):
        _parse_completion_logprobs(choice, choice["token_ids"])


def test_adapted_answer_gives_renderers_vllms_exact_logprobs():
    answer = adapter.renderers_logprobs(recorded())
    (choice,) = answer["choices"]
    raw = recorded()["choices"][0]
    assert choice["token_ids"] == raw["token_ids"]
    assert _parse_completion_logprobs(choice, choice["token_ids"]) == [e["logprob"] for e in raw["logprobs"]["content"]]


def test_adapter_leaves_an_answer_already_in_renderers_shape():
    answer = recorded()
    for entry in answer["choices"][0]["logprobs"]["content"]:
        entry["token"] = "token_id:1"  # wrong on purpose: not overwritten, so renderers still checks it
    assert adapter.renderers_logprobs(answer)["choices"][0]["logprobs"]["content"][0]["token"] == "token_id:1"


class Upstream:
    """Two fake generate endpoints; `fail` maps an endpoint to the status it answers with."""

    def __init__(self, fail: dict[str, int] | None = None):
        self.fail, self.seen = fail or {}, []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        host = f"http://{request.url.host}:{request.url.port}"
        self.seen.append((host, request.url.path, json.loads(request.content) if request.content else None))
        if host in self.fail:
            return httpx.Response(self.fail[host], json={"error": {"message": f"{host} says no"}})
        return httpx.Response(200, content=RECORDED.read_bytes())


A, B = "http://127.0.0.1:9101", "http://127.0.0.1:9102"


def routed(upstream: Upstream) -> tuple[InferenceClient, adapter.GenerateRoute, httpx.AsyncClient]:
    client = InferenceClient([A, B], weight_sync="none", max_attempts=2, backoff_s=60)
    client._http = httpx.AsyncClient(transport=httpx.MockTransport(upstream))
    route = adapter.GenerateRoute(client)
    return client, route, httpx.AsyncClient(transport=adapter.RoutedTransport(route), base_url="http://orch.invalid")


def generate(http: httpx.AsyncClient, session: str):
    return http.post(
        adapter.GENERATE_PATH,
        content=orjson.dumps({"token_ids": [1, 2], "sampling_params": {}}),
        headers={"X-Session-ID": session},
    )


def test_a_groups_calls_stay_on_one_endpoint_and_are_recorded_as_answered():
    upstream = Upstream()
    client, route, http = routed(upstream)

    async def main():
        route.open("trace-a", pin=7)
        route.open("trace-b", pin=7)
        route.open("trace-c", pin=8)
        for session in ("trace-a", "trace-b", "trace-c", "trace-a"):
            resp = await generate(http, session)
            assert resp.status_code == 200
            assert resp.json()["choices"][0]["logprobs"]["content"][0]["token"] == "token_id:260"
        return route.close("trace-a"), route.close("trace-c")

    a, c = asyncio.run(main())
    pinned = {call.endpoint for call in a.calls}
    assert len(pinned) == 1 and len(a.calls) == 2
    assert {host for host, _, _ in upstream.seen[:2]} == pinned  # trace-b (same group) went there too
    assert c.calls[0].endpoint != a.calls[0].endpoint  # the least loaded other one
    assert a.calls[0].answer == recorded()  # what vLLM answered, not the adapted copy
    assert route.close("trace-a") is None


def test_a_failed_endpoint_is_retried_on_the_other_and_marked_down():
    upstream = Upstream(fail={A: 503})
    client, route, http = routed(upstream)

    async def main():
        route.open("t", pin=1)
        resp = await generate(http, "t")
        return resp, route.close("t")

    resp, rollout = asyncio.run(main())
    assert resp.status_code == 200
    (call,) = rollout.calls
    assert (call.endpoint, call.attempts) == (B, 2)
    assert [host for host, _, _ in upstream.seen] == [A, B]
    assert client.status()[0]["up"] is False and client.retries == 1


def test_retries_are_bounded_and_a_rejected_request_is_not_retried():
    for fail, status, calls in (({A: 503, B: 502}, 503, 2), ({A: 400, B: 400}, 400, 1)):
        upstream = Upstream(fail=fail)
        _, route, http = routed(upstream)

        async def main(route=route, http=http):
            route.open("t", pin=1)
            return await generate(http, "t")

        resp = asyncio.run(main())
        assert resp.status_code == status, fail
        assert len(upstream.seen) == calls
        assert route.close("t").calls == []


def test_a_call_of_an_unknown_rollout_is_refused():
    upstream = Upstream()
    _, _, http = routed(upstream)
    resp = asyncio.run(generate(http, "never-opened"))
    assert resp.status_code == 400 and "unknown rollout" in resp.json()["error"]["message"]
    assert upstream.seen == []


def test_task_draw_is_a_seeded_permutation_per_pass_and_env():
    size = 10
    for seed in (0, 1):
        draws = [task_index(seed, cursor, size, "verifiers") for cursor in range(3 * size)]
        assert draws == [task_index(seed, cursor, size, "verifiers") for cursor in range(3 * size)]
        for start in range(0, 3 * size, size):
            assert sorted(draws[start : start + size]) == list(range(size))
        assert draws[:size] != draws[size : 2 * size]
    first_pass = [task_index(0, c, size, "verifiers") for c in range(size)]
    assert first_pass != [task_index(1, c, size, "verifiers") for c in range(size)]
    assert first_pass != [task_index(0, c, size, "nemo_gym") for c in range(size)]
    assert [task_index(0, c, None, "verifiers") for c in range(5)] == [0, 1, 2, 3, 4]


def verifiers_config(**section) -> list[str]:
    sets = [
        'envs={"verifiers": 1.0}',
        'inference.openai.endpoints=["http://127.0.0.1:9"]',
        "inference.openai.weight_sync=vllm_reload",
    ]
    return sets + [f"env.verifiers.{key}={json.dumps(value)}" for key, value in section.items()]


def test_config_refuses_a_missing_taskset_in_one_line():
    config = load_config(overrides=verifiers_config(taskset="orch_no_such_taskset", path=[str(TASKSETS)]))
    with pytest.raises(ConfigError) as err:  # before the run, not while the config is validated
        config.env.verifiers.preflight(config.seed)
    message = str(err.value)
    assert "no module 'orch_no_such_taskset'" in message and str(TASKSETS) in message
    assert "\n" not in message


def test_config_refuses_a_taskset_without_a_trainable_agent():
    config = load_config(overrides=verifiers_config(taskset="orch_test_untrainable", path=[str(TASKSETS)]))
    with pytest.raises(ConfigError, match="JudgeOnlyEnv has no trainable agent") as err:
        config.env.verifiers.preflight(config.seed)
    assert "\n" not in str(err.value)


def test_config_needs_the_openai_backend_and_accepts_the_examples_tasksets():
    with pytest.raises(ConfigError, match="samples through inference.kind='openai'"):
        load_config(
            overrides=[
                s
                for s in verifiers_config(taskset="orch_reverse_text", path=[str(EXAMPLES)])
                if not s.startswith("inference.")
            ]
        )
    for taskset in ("orch_reverse_text", "orch_reverse_text_two_turn"):
        config = load_config(overrides=verifiers_config(taskset=taskset, path=[str(EXAMPLES)]))
        config.env.verifiers.preflight(config.seed)
        assert config.env.verifiers.taskset == taskset


@pytest.mark.slow
@pytest.mark.parametrize(
    "taskset, message",
    [
        ("orch_no_such_taskset", "no module 'orch_no_such_taskset'"),
        ("orch_test_untrainable", "JudgeOnlyEnv has no trainable agent"),
    ],
)
def test_orch_run_refuses_a_taskset_it_cannot_train_on_before_the_run(tmp_path, taskset, message):
    assignments = verifiers_config(taskset=taskset, path=[str(TASKSETS)])
    done = orch("run", "--runs-dir", str(tmp_path), "--name", "r", *sets(*assignments), timeout=300, env=orch_env())
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("orch: error: invalid config: ")
    assert message in done.stderr
    assert not (tmp_path / "r").exists()  # nothing was created


def test_each_call_of_a_rollout_records_the_version_it_was_sampled_with():
    upstream = Upstream()
    client, route, http = routed(upstream)

    async def main():
        route.open("t", pin=1)
        await client.load(0, "")
        await generate(http, "t")
        await client.load(1, "")  # a version published between the two turns of one episode
        await generate(http, "t")
        return route.close("t")

    first, second = asyncio.run(main()).calls
    assert (first.policy_start, first.policy_end, second.policy_start, second.policy_end) == (0, 0, 1, 1)
    assert first.route_s >= first.http_s > 0


def held_out_env(size: int, held_out: dict):
    from orchestrator.verifiers.component import VerifiersConfig
    from orchestrator.verifiers.env import VerifiersEnv

    section = VerifiersConfig(
        taskset="orch_reverse_text", path=[str(EXAMPLES)], taskset_config={"size": size}, held_out=held_out
    )
    return VerifiersEnv(section, seed=3, temperature=1.0, max_tokens=8, model="m", renderer_model="m")


def test_held_out_tasks_are_an_evals_and_never_a_train_groups():
    env = held_out_env(12, {"idx": ["2:5"], "names": ["reverse_text#9"]})
    held_out = ["reverse_text#2", "reverse_text#3", "reverse_text#4", "reverse_text#9"]
    train = [env.task(cursor).data.name for cursor in range(3 * 8)]
    assert not set(train) & set(held_out)
    for start in range(0, 3 * 8, 8):  # each pass over the 8 train tasks is a permutation of them
        assert len(set(train[start : start + 8])) == 8
    # eval task -i: the held-out tasks' i-th in taskset order, wrapping around
    assert [env.task(-i).data.name for i in range(1, 7)] == held_out + held_out[:2]


def test_without_held_out_tasks_an_eval_task_is_refused_and_train_draws_are_the_whole_taskset():
    from orchestrator.verifiers.env import VerifiersEpisodeError

    env = held_out_env(6, {})
    assert {env.task(cursor).data.name for cursor in range(6)} == {f"reverse_text#{i}" for i in range(6)}
    with pytest.raises(VerifiersEpisodeError, match="without env.verifiers.held_out"):
        env.task(-1)


@pytest.mark.parametrize(
    "held_out, message",
    [
        ({"idx": ["300:400"]}, "leaves taskset 'orch_reverse_text' no held-out task"),
        ({"idx": ["0:"]}, "leaves taskset 'orch_reverse_text' no train task"),
        ({"idx": [-1]}, "idx -1 is negative"),
        ({"indices": [1]}, "indices"),
    ],
)
def test_config_refuses_held_out_tasks_that_leave_a_split_empty_or_are_no_task_match(held_out, message):
    config = load_config(
        overrides=verifiers_config(taskset="orch_reverse_text", path=[str(EXAMPLES)], held_out=held_out)
    )
    with pytest.raises(ConfigError, match=message) as err:
        config.env.verifiers.preflight(config.seed)
    assert "\n" not in str(err.value) and str(err.value).startswith("invalid config: env.verifiers.held_out")


def test_config_refuses_evals_of_a_taskset_without_held_out_tasks_and_takes_them_with():
    evals = ['eval.envs=["verifiers"]']
    with pytest.raises(ConfigError, match="draw from env.verifiers.held_out .* which is empty"):
        load_config(overrides=verifiers_config(taskset="orch_reverse_text", path=[str(EXAMPLES)]) + evals)
    section = {"taskset": "orch_reverse_text", "path": [str(EXAMPLES)], "held_out": {"idx": ["0:32"]}}
    config = load_config(overrides=verifiers_config(**section) + evals)
    config.env.verifiers.preflight(config.seed)
    assert config.env.verifiers.solved(1.0) and not config.env.verifiers.solved(0.99)
    unscored = load_config(overrides=verifiers_config(**section, success_threshold=None) + evals)
    assert unscored.env.verifiers.solved(1.0) is None
