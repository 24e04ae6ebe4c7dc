"""The wire format: request validation (orch serve) and response parsing (any OpenAI-compatible server)."""

from __future__ import annotations

import pytest

from orchestrator.inference.protocol import ProtocolError, parse_completion, parse_completion_request


def test_request_defaults_and_prompt_forms():
    p = parse_completion_request({"prompt": "abc"})
    assert (p.prompts, p.n, p.max_tokens, p.temperature, p.logprobs, p.seed) == (["abc"], 1, 16, 1.0, None, None)
    assert parse_completion_request({"prompt": [1, 8, 3]}).prompts == [[1, 8, 3]]
    assert parse_completion_request({"prompt": ["ab", [1, 8, 3]]}).prompts == ["ab", [1, 8, 3]]
    p = parse_completion_request(
        {
            "prompt": "a",
            "n": 4,
            "logprobs": 0,
            "seed": 9,
            "return_tokens_as_token_ids": True,
            "return_token_ids": True,
            "some_vendor_field": 1,
        }
    )
    assert (p.n, p.logprobs, p.seed, p.tokens_as_ids) == (4, 0, 9, True)


@pytest.mark.parametrize(
    "body, message",
    [
        ([], "JSON object"),
        ({}, "'prompt'"),
        ({"prompt": []}, "'prompt'"),
        ({"prompt": [1, True]}, "'prompt'"),
        ({"prompt": "a", "n": 0}, "'n'"),
        ({"prompt": "a", "temperature": 0}, "greedy"),
        ({"prompt": "a", "top_p": 0.9}, "top_p"),
        ({"prompt": "a", "stream": True}, "stream"),
        ({"prompt": "a", "stop": ["x"]}, "stop"),
        ({"prompt": "a", "logprobs": 21}, "'logprobs'"),
        ({"prompt": "a", "seed": "1"}, "'seed'"),
        ({"prompt": "a", "seed": 2**64}, r"'seed' must be an integer in \[0, 2\*\*63\)"),  # would fail its batch
        ({"prompt": "a", "seed": -1}, "'seed'"),
        ({"prompt": "a", "n": 2, "best_of": 3}, "best_of"),
    ],
)
def test_bad_requests_name_the_field(body, message):
    with pytest.raises(ProtocolError, match=message):
        parse_completion_request(body)


VLLM_STYLE = {  # vLLM /v1/completions with logprobs=0 and return_tokens_as_token_ids=true
    "id": "cmpl-1",
    "object": "text_completion",
    "model": "m",
    "choices": [
        {
            "index": 1,
            "text": "yz",
            "logprobs": {
                "tokens": ["token_id:7", "token_id:2"],
                "token_logprobs": [-0.5, -0.25],
                "top_logprobs": None,
                "text_offset": [0, 1],
            },
            "finish_reason": "stop",
        },
        {
            "index": 0,
            "text": "x",
            "logprobs": {"tokens": ["token_id:5"], "token_logprobs": [-1.0]},
            "finish_reason": "length",
            "prompt_token_ids": [1, 3],
        },
    ],
}


def test_vllm_token_id_strings_are_parsed_and_choices_ordered():
    choices, version = parse_completion(VLLM_STYLE, 2)
    assert version is None
    assert [c.token_ids for c in choices] == [[5], [7, 2]]
    assert [c.logprobs for c in choices] == [[-1.0], [-0.5, -0.25]]
    assert choices[0].prompt_ids == [1, 3] and choices[1].prompt_ids is None
    assert choices[1].finish_reason == "stop"


def test_return_token_ids_field_wins_and_policy_version_is_read():
    resp = {
        "policy_version": 4,
        "choices": [
            {
                "index": 0,
                "text": "ab",
                "token_ids": [9, 10],
                "prompt_token_ids": [1, 3],
                "logprobs": {"tokens": ["a", "b"], "token_logprobs": [-0.1, 0.0]},
            }
        ],
    }
    (choice,), version = parse_completion(resp, 1)
    assert version == 4 and choice.token_ids == [9, 10] and choice.logprobs == [-0.1, 0.0]


@pytest.mark.parametrize(
    "choice, message",
    [
        ({"text": "a", "logprobs": None}, "no per-token logprobs"),
        ({"text": "a", "logprobs": {"tokens": ["a"], "token_logprobs": [-1.0]}}, "return_token_ids"),
        ({"text": "a", "token_ids": [1, 2], "logprobs": {"token_logprobs": [-1.0]}}, "2 token ids but 1 logprobs"),
        ({"text": "a", "token_ids": [1], "logprobs": {"token_logprobs": [0.5]}}, "<= 0"),
        ({"text": "a", "token_ids": [1], "logprobs": {"token_logprobs": [None]}}, "finite"),
        ({"token_ids": [1], "logprobs": {"token_logprobs": [-1.0]}}, "'text'"),
    ],
)
def test_responses_without_ids_or_logprobs_are_rejected_clearly(choice, message):
    with pytest.raises(ProtocolError, match=message):
        parse_completion({"choices": [choice]}, 1)


def test_wrong_choice_count_is_an_error():
    with pytest.raises(ProtocolError, match="expected 3 choices"):
        parse_completion(VLLM_STYLE, 3)


@pytest.mark.parametrize("bad", [False, True, "x", None, 1e-3])
def test_a_bad_logprob_is_named_whatever_it_is(bad):
    choice = {"text": "a", "token_ids": [1, 2], "logprobs": {"token_logprobs": [-1.0, bad]}}
    with pytest.raises(ProtocolError, match="is not a finite number <= 0"):
        parse_completion({"choices": [choice]}, 1)


def test_logprobs_a_rounding_above_zero_are_clamped_to_zero():
    choice = {"text": "a", "token_ids": [1, 2, 3], "logprobs": {"token_logprobs": [-0.5, 5e-7, 0]}}
    (parsed,), _ = parse_completion({"choices": [choice]}, 1)
    assert parsed.logprobs == [-0.5, 0.0, 0.0] and all(type(lp) is float for lp in parsed.logprobs)
