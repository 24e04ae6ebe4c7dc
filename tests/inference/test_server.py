"""`orch serve` on 127.0.0.1: completions consistent with the policy, weight updates, bad requests."""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest

from orchestrator.serve.policy import load_policy, sequence_logprobs
from orchestrator.serve.tokenizer import EOS, decode, encode_prompt
from tests.inference.util import publish, serving


@pytest.fixture
def weights(tmp_path):
    return [publish(tmp_path, 0), publish(tmp_path, 1)]


def post(url, path, body, **kw):
    return httpx.post(url + path, json=body, timeout=30, **kw)


def test_round_trip_token_ids_and_logprobs_are_the_policys(weights):
    with serving() as srv:
        assert post(srv.base_url, "/update_weights", {"path": str(weights[0]), "version": 0}).json()["version"] == 0
        prompt = encode_prompt("abcdh")
        body = {
            "prompt": prompt,
            "n": 3,
            "max_tokens": 24,
            "temperature": 0.7,
            "logprobs": 0,
            "seed": 11,
            "return_tokens_as_token_ids": True,
        }
        resp = post(srv.base_url, "/v1/completions", body)
        assert resp.status_code == 200, resp.text
        out = resp.json()
        assert out["object"] == "text_completion" and out["model"] == "orch-policy" and out["policy_version"] == 0
        model = load_policy(weights[0])
        assert [c["index"] for c in out["choices"]] == [0, 1, 2]
        for c in out["choices"]:
            ids = c["token_ids"]
            assert c["prompt_token_ids"] == prompt
            assert c["logprobs"]["tokens"] == [f"token_id:{t}" for t in ids]
            assert c["text"] == decode(ids)
            assert c["finish_reason"] == ("stop" if ids[-1] == EOS else "length")
            assert len(ids) <= 24 and (ids[-1] == EOS or len(ids) == 24)
            recomputed = sequence_logprobs(model, prompt + ids, len(prompt), 0.7)
            assert c["logprobs"]["token_logprobs"] == pytest.approx(recomputed, abs=1e-4)
        total = sum(len(c["token_ids"]) for c in out["choices"])
        assert out["usage"] == {
            "prompt_tokens": len(prompt),
            "completion_tokens": total,
            "total_tokens": len(prompt) + total,
        }
        # Same seed and weights -> same completions; a text prompt is rendered to the same ids.
        again = post(srv.base_url, "/v1/completions", {**body, "prompt": "abcdh"}).json()
        assert [c["token_ids"] for c in again["choices"]] == [c["token_ids"] for c in out["choices"]]
        # Without return_tokens_as_token_ids the tokens are text pieces (offsets follow them).
        plain = post(srv.base_url, "/v1/completions", {**body, "return_tokens_as_token_ids": False}).json()
        c = plain["choices"][0]
        assert "".join(c["logprobs"]["tokens"]) == c["text"]
        assert (
            post(srv.base_url, "/v1/completions", {**body, "logprobs": None}).json()["choices"][0]["logprobs"] is None
        )


def test_weight_update_changes_the_served_version(weights, tmp_path):
    with serving() as srv:
        url = srv.base_url
        assert httpx.get(url + "/version").json() == {"version": -1, "path": None}
        assert httpx.get(url + "/health").json()["loaded"] is False
        resp = post(url, "/v1/completions", {"prompt": "ab"})
        assert resp.status_code == 503 and resp.json()["error"]["type"] == "no_weights"
        for v in (0, 1):
            answer = post(url, "/update_weights", {"path": str(weights[v]), "version": v}).json()
            assert answer == {"version": v, "requested": v, "ignored": False, "path": str(weights[v])}
            out = post(
                url, "/v1/completions", {"prompt": [1, 8, 9, 3], "max_tokens": 8, "logprobs": 0, "seed": 3}
            ).json()
            assert out["policy_version"] == v
            c = out["choices"][0]
            recomputed = sequence_logprobs(load_policy(weights[v]), [1, 8, 9, 3] + c["token_ids"], 4, 1.0)
            assert c["logprobs"]["token_logprobs"] == pytest.approx(recomputed, abs=1e-4)
        assert post(url, "/update_weights", {"path": str(weights[0]), "version": 0}).json()["ignored"] is True
        assert httpx.get(url + "/version").json()["version"] == 1
        assert httpx.get(url + "/v1/models").json()["data"][0]["policy_version"] == 1
        missing = post(url, "/update_weights", {"path": str(tmp_path / "weights" / "step_9"), "version": 9})
        assert missing.status_code == 409 and "STABLE" in missing.json()["error"]["message"]
        assert post(url, "/update_weights", {"path": str(weights[0])}).status_code == 400
        assert srv.policy.stats["reloads"] == 2


@pytest.mark.parametrize(
    "body, status, message",
    [
        ({"prompt": "ab", "model": "other"}, 404, "does not exist"),
        ({"prompt": "abz"}, 400, "not in the vocabulary"),
        ({"prompt": [1, 8, 9]}, 400, "rendered prompt"),
        ({"prompt": [1, 999, 3]}, 400, "out of range"),
        ({"prompt": "ab", "max_tokens": 500}, 400, "max_tokens"),
        ({"prompt": "a" * 40}, 400, "at most"),
        ({"prompt": "ab", "stream": True}, 400, "stream"),
    ],
)
def test_bad_requests_are_4xx_with_openai_error_bodies(weights, body, status, message):
    with serving() as srv:
        post(srv.base_url, "/update_weights", {"path": str(weights[0]), "version": 0})
        resp = post(srv.base_url, "/v1/completions", body)
        assert resp.status_code == status
        assert message in resp.json()["error"]["message"] and resp.json()["error"]["code"] == status


def test_concurrent_requests_share_sampling_calls_and_stay_seeded(weights):
    with serving() as srv:
        post(srv.base_url, "/update_weights", {"path": str(weights[0]), "version": 0})

        def one(seed):
            body = {"prompt": "abc" if seed % 2 else "hgfed", "max_tokens": 20, "logprobs": 0, "seed": seed}
            return post(srv.base_url, "/v1/completions", body).json()["choices"][0]

        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            batched = list(pool.map(one, range(32)))
        assert srv.policy.stats["sample_calls"] < 32  # coalesced
        alone = [one(seed) for seed in (0, 1, 5)]
        for seed, c in zip((0, 1, 5), alone):  # a request's sample does not depend on its batch
            assert c["token_ids"] == batched[seed]["token_ids"]
            assert c["logprobs"]["token_logprobs"] == pytest.approx(
                batched[seed]["logprobs"]["token_logprobs"], abs=1e-4
            )


def test_a_server_reused_by_another_run_loads_that_runs_weights(weights, tmp_path):
    """A lower version from the same run is an out-of-order load (ignored); from another run's
    weights dir it is a new run starting on this server: its step_0 replaces the old run's step_1."""
    other = publish(tmp_path / "other-run", 0, seed=7)
    with serving() as srv:
        url = srv.base_url
        for v in (0, 1):
            post(url, "/update_weights", {"path": str(weights[v]), "version": v})
        answer = post(url, "/update_weights", {"path": str(other), "version": 0}).json()
        assert answer == {"version": 0, "requested": 0, "ignored": False, "path": str(other)}
        out = post(url, "/v1/completions", {"prompt": [1, 8, 9, 3], "max_tokens": 8, "logprobs": 0, "seed": 3}).json()
        recomputed = sequence_logprobs(load_policy(other), [1, 8, 9, 3] + out["choices"][0]["token_ids"], 4, 1.0)
        assert out["policy_version"] == 0
        assert out["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(recomputed, abs=1e-4)
