"""The OpenAI-compatible completions wire format, as `orch serve` speaks it and the client reads it.

Request (``POST /v1/completions``, JSON; unknown fields are ignored, as vLLM does)::

    model        str, optional: must be the served name when given (404 otherwise)
    prompt       str | [int] | [str] | [[int]]: text (rendered BOS + chars + SEP by the server)
                 or the prompt's token ids exactly as the policy sees them
    n            int >= 1 (default 1): completions per prompt, all from one seeded generator
    max_tokens   int >= 1 (default 16)
    temperature  float > 0 (default 1.0); logprobs are those of softmax(logits / temperature)
    logprobs     int 0..20 or null (default null): include the per-token logprobs block
    seed         int in [0, 2**63), optional: the sampling seed (same weights + request -> same completion)
    return_tokens_as_token_ids  bool (vLLM): ``logprobs.tokens`` entries become ``"token_id:N"``
    return_token_ids            bool (vLLM >= 0.10.2): accepted; orch serve always returns ids
    top_p must be 1, stop must be empty, stream/echo must be false (else 400).

Response (vLLM's shape plus two fields)::

    {"id": "cmpl-...", "object": "text_completion", "created": unix_s, "model": name,
     "policy_version": N,                      # orch extension: the weights that sampled it
     "choices": [{"index": i, "text": str,     # decoded completion (stops at EOS)
                  "token_ids": [int],          # sampled ids, EOS included when sampled (vLLM)
                  "prompt_token_ids": [int],   # the prompt as the policy saw it (vLLM)
                  "logprobs": {"tokens": [str], "token_logprobs": [float],
                               "top_logprobs": [{token: logprob}], "text_offset": [int]} | null,
                  "finish_reason": "stop" | "length", "stop_reason": null}],
     "usage": {"prompt_tokens", "completion_tokens", "total_tokens"}}

``choices[i]`` for prompt p and sample k has ``index = p * n + k``. ``top_logprobs`` holds only
the sampled token (the embedded sampler does not rank alternatives). Errors use OpenAI's shape:
``{"error": {"message", "type", "param", "code"}}``.

This module imports no torch: the client side (:func:`parse_completion`) runs in `orch run`.
"""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass
from typing import Any

TOKEN_ID_PREFIX = "token_id:"
MAX_N = 64
MAX_LOGPROBS = 20

# vLLM's token-in, token-out sampling route (its `--enable-scale-out`), which verifiers' train client
# posts and orch's NeMo Gym route samples on.
GENERATE_PATH = "/inference/v1/generate"


class ProtocolError(ValueError):
    """A request or response that does not follow the format above; one-line message."""


# ------------------------------------------------------------------------------ server side
@dataclass(frozen=True)
class CompletionParams:
    model: str | None
    prompts: list[str | list[int]]  # text or token ids, one per prompt
    n: int
    max_tokens: int
    temperature: float
    logprobs: int | None
    seed: int | None
    tokens_as_ids: bool


def _int(body: dict, key: str, default: int | None, lo: int, hi: int | None = None) -> int | None:
    value = body.get(key, default)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < lo or (hi is not None and value > hi):
        bound = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ProtocolError(f"'{key}' must be an integer in {bound}, got {value!r}")
    return value


_INT_ONLY = frozenset({int})


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and _INT_ONLY.issuperset(map(type, value))  # JSON ints; not bools


def parse_completion_request(body: Any) -> CompletionParams:
    """Validate a ``/v1/completions`` body; raises :class:`ProtocolError` naming the problem."""
    if not isinstance(body, dict):
        raise ProtocolError("body must be a JSON object")
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        prompts: list = [prompt]
    elif _is_ids(prompt) and prompt:
        prompts = [list(prompt)]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or (_is_ids(p) and p) for p in prompt):
        prompts = [p if isinstance(p, str) else list(p) for p in prompt]
    else:
        raise ProtocolError("'prompt' must be a string, a non-empty list of token ids, or a list of either")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ProtocolError("'model' must be a string")
    temperature = body.get("temperature", 1.0)
    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, (int, float))
        or not math.isfinite(temperature)
        or not 0 < temperature <= 100
    ):
        raise ProtocolError(
            f"'temperature' must be a number in (0, 100] (greedy decoding is not offered), got {temperature!r}"
        )
    top_p = body.get("top_p", 1.0)
    if top_p not in (None, 1, 1.0):
        raise ProtocolError(f"'top_p' must be 1 (orch serve samples the full distribution), got {top_p!r}")
    for flag in ("stream", "echo"):
        if body.get(flag):
            raise ProtocolError(f"'{flag}' is not supported by orch serve")
    if body.get("stop") not in (None, "", []):
        raise ProtocolError("'stop' is not supported by orch serve (completions end at EOS or max_tokens)")
    best_of = body.get("best_of")
    n = _int(body, "n", 1, 1, MAX_N)
    if best_of not in (None, n):
        raise ProtocolError("'best_of' must equal 'n' when given")
    seed = body.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63):
        # torch.Generator.manual_seed refuses the rest, and a request is sampled in a batch with
        # others: caught here, one caller's bad seed cannot fail the batch it would join.
        raise ProtocolError(f"'seed' must be an integer in [0, 2**63), got {seed!r}")
    return CompletionParams(
        model=model,
        prompts=prompts,
        n=n,
        max_tokens=_int(body, "max_tokens", 16, 1),
        temperature=float(temperature),
        logprobs=_int(body, "logprobs", None, 0, MAX_LOGPROBS),
        seed=seed,
        tokens_as_ids=bool(body.get("return_tokens_as_token_ids", False)),
    )


def error_body(message: str, code: int, kind: str = "invalid_request_error", param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def choice_body(
    index: int,
    prompt_ids: list[int],
    token_ids: list[int],
    logprobs: list[float],
    text: str,
    finished: bool,
    *,
    with_logprobs: bool,
    tokens_as_ids: bool,
    token_text,
) -> dict:
    """One ``choices[i]`` entry; ``token_text(id) -> str`` renders a token for ``logprobs.tokens``."""
    block = None
    if with_logprobs:
        tokens = [f"{TOKEN_ID_PREFIX}{t}" if tokens_as_ids else token_text(t) for t in token_ids]
        offsets, at = [], 0
        for t in token_ids:
            offsets.append(at)
            at += len(token_text(t))
        block = {
            "tokens": tokens,
            "token_logprobs": list(logprobs),
            "top_logprobs": [{tok: lp} for tok, lp in zip(tokens, logprobs)],
            "text_offset": offsets,
        }
    return {
        "index": index,
        "text": text,
        "token_ids": list(token_ids),
        "prompt_token_ids": list(prompt_ids),
        "logprobs": block,
        "finish_reason": "stop" if finished else "length",
        "stop_reason": None,
    }


# ------------------------------------------------------------------------------ client side
@dataclass(frozen=True)
class ParsedChoice:
    prompt_ids: list[int] | None  # None when the server did not echo them
    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str | None


def _token_id(token: Any, where: str) -> int:
    if isinstance(token, str) and token.startswith(TOKEN_ID_PREFIX):
        try:
            return int(token[len(TOKEN_ID_PREFIX) :])
        except ValueError:
            pass
    raise ProtocolError(
        f"{where}: no token ids in the response (got token {token!r}); ask for them with "
        f"'return_token_ids' (vLLM >= 0.10.2, SGLang) or 'return_tokens_as_token_ids'"
    )


def parse_choice(choice: Any, response: dict, where: str = "response") -> ParsedChoice:
    """Token ids and per-token logprobs of one choice of any OpenAI-compatible server.

    Ids come from ``choice.token_ids`` (vLLM/SGLang ``return_token_ids``), else from
    ``logprobs.tokens`` in vLLM's ``token_id:N`` form; logprobs from ``logprobs.token_logprobs``.
    The prompt ids from ``choice.prompt_token_ids`` (else the response's top level), if any.
    """
    if not isinstance(choice, dict):
        raise ProtocolError(f"{where}: a choice is not an object")
    block = choice.get("logprobs")
    if not isinstance(block, dict) or not isinstance(block.get("token_logprobs"), list):
        raise ProtocolError(f"{where}: no per-token logprobs in the response (send 'logprobs': 0 or more)")
    logprobs = block["token_logprobs"]
    ids = choice.get("token_ids")
    if ids is None:
        tokens = block.get("tokens")
        if not isinstance(tokens, list):
            raise ProtocolError(f"{where}: neither 'token_ids' nor 'logprobs.tokens' in the response")
        ids = [_token_id(t, where) for t in tokens]
    if not _is_ids(ids):
        raise ProtocolError(f"{where}: 'token_ids' must be a list of integers")
    if len(ids) != len(logprobs):
        raise ProtocolError(f"{where}: {len(ids)} token ids but {len(logprobs)} logprobs")
    clean = _logprobs(logprobs, where)
    prompt_ids = choice.get("prompt_token_ids", response.get("prompt_token_ids"))
    if prompt_ids is not None and not _is_ids(prompt_ids):
        raise ProtocolError(f"{where}: 'prompt_token_ids' must be a list of integers")
    text = choice.get("text")
    if not isinstance(text, str):
        raise ProtocolError(f"{where}: a choice has no 'text'")
    return ParsedChoice(prompt_ids, ids, clean, text, choice.get("finish_reason"))


def _logprobs(logprobs: list, where: str) -> list[float]:
    """The logprobs as floats <= 0 (a rounding above 0 clamped), or ProtocolError naming a bad one.
    The common case, all finite numbers, is checked on a C array rather than value by value."""
    try:
        values = array("d", logprobs)
    except (TypeError, OverflowError):
        values = None
    if (
        values is not None
        and values == values  # no NaN
        and (not values or (max(values) <= 1e-6 and min(values) > -math.inf))
        and bool not in set(map(type, logprobs))
    ):
        clean = values.tolist()
        return [min(lp, 0.0) for lp in clean] if clean and max(clean) > 0.0 else clean
    clean = []
    for lp in logprobs:
        if isinstance(lp, bool) or not isinstance(lp, (int, float)) or not math.isfinite(lp) or lp > 1e-6:
            raise ProtocolError(f"{where}: logprob {lp!r} is not a finite number <= 0")
        clean.append(min(float(lp), 0.0))
    return clean


def parse_completion(response: Any, expected: int, where: str = "response") -> tuple[list[ParsedChoice], int | None]:
    """All choices (ordered by ``index``) and the ``policy_version`` the server reported, if any."""
    if not isinstance(response, dict) or not isinstance(response.get("choices"), list):
        raise ProtocolError(f"{where}: not a completions response (no 'choices' list)")
    choices = sorted(response["choices"], key=lambda c: c.get("index", 0) if isinstance(c, dict) else 0)
    if len(choices) != expected:
        raise ProtocolError(f"{where}: expected {expected} choices, got {len(choices)}")
    version = response.get("policy_version")
    if version is not None and (not isinstance(version, int) or isinstance(version, bool)):
        raise ProtocolError(f"{where}: 'policy_version' must be an integer")
    return [parse_choice(c, response, where) for c in choices], version


def parse_generated(
    response: Any, expected: int, where: str = "response"
) -> list[tuple[ParsedChoice, tuple[tuple[str, int], ...]]]:
    """Each choice (ordered by ``index``) of vLLM's ``/inference/v1/generate`` answer with
    ``output_mode`` "text", and its tokens' weight versions as (label, tokens) runs covering
    every token in order: the engine's ``weight_versions`` spans (vLLM 0.32: each span the
    output tokens ``[start, end)`` that weights labelled ``version`` sampled)."""
    if not isinstance(response, dict) or not isinstance(response.get("choices"), list):
        raise ProtocolError(f"{where}: not a generate response (no 'choices' list)")
    choices = sorted(response["choices"], key=lambda c: c.get("index", 0) if isinstance(c, dict) else 0)
    if len(choices) != expected:
        raise ProtocolError(f"{where}: expected {expected} choices, got {len(choices)}")
    return [_generated_choice(c, response, where) for c in choices]


def _generated_choice(choice: Any, response: dict, where: str) -> tuple[ParsedChoice, tuple[tuple[str, int], ...]]:
    if not isinstance(choice, dict):
        raise ProtocolError(f"{where}: a choice is not an object")
    block = choice.get("logprobs")
    content = block.get("content") if isinstance(block, dict) else None
    if not isinstance(content, list) or not all(isinstance(entry, dict) for entry in content):
        raise ProtocolError(f"{where}: no per-token logprobs in the response (send sampling_params.logprobs: 0)")
    as_completion = {
        **choice,
        "logprobs": {"token_logprobs": [entry.get("logprob") for entry in content]},
        "prompt_token_ids": response.get("prompt_token_ids"),
    }
    parsed = parse_choice(as_completion, response, where)
    return parsed, _version_spans(choice.get("weight_versions"), len(parsed.token_ids), where)


def _version_spans(spans: Any, tokens: int, where: str) -> tuple[tuple[str, int], ...]:
    """``weight_versions`` as (label, tokens) runs, checked to cover the tokens in order."""
    if not tokens and not spans:
        return ()
    if not isinstance(spans, list) or not spans:
        raise ProtocolError(
            f"{where}: no 'weight_versions' in the answer (vLLM >= 0.32 reports them on /inference/v1/generate)"
        )
    runs, at = [], 0
    for span in spans:
        if not isinstance(span, dict):
            raise ProtocolError(f"{where}: a weight_versions span is not an object")
        label, start, end = span.get("version"), span.get("start"), span.get("end")
        if not isinstance(label, str) or start != at or not isinstance(end, int) or isinstance(end, bool) or end <= at:
            raise ProtocolError(f"{where}: weight_versions {spans!r} do not cover the {tokens} tokens in order")
        runs.append((label, end - start))
        at = end
    if at != tokens:
        raise ProtocolError(f"{where}: weight_versions {spans!r} do not cover the {tokens} tokens in order")
    return tuple(runs)
