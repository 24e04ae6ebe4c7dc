"""The weight-sync dialects say what the rest of orch needs of them (orchestrator.inference.weight_sync):
the config's names, the pre-run checks and the launched servers ask the registry, so that a
dialect is a module and a line of `DIALECTS`."""

from __future__ import annotations

import typing

import pytest

from orchestrator.inference.endpoints_config import EndpointsSettings, LaunchSection
from orchestrator.inference.preflight import ENGINE_NAMES
from orchestrator.inference.vllm_launch import VllmLauncher
from orchestrator.inference.weight_sync import DIALECTS


def test_the_config_offers_every_dialect_by_its_name():
    annotation = EndpointsSettings.model_fields["weight_sync"].annotation
    assert typing.get_args(annotation) == tuple(DIALECTS)


@pytest.mark.parametrize("name", DIALECTS)
def test_each_dialect_says_what_it_loads_and_offers(name):
    dialect = DIALECTS[name]
    assert dialect.engine is None or dialect.engine in ENGINE_NAMES  # an engine the pre-run check tells apart
    assert dialect.loads == (dialect.engine is not None)
    assert dialect.default_update_mode in dialect.update_modes
    assert dialect.summary
    if dialect.engine == "vllm":  # given vLLM endpoints are checked for its routes before the run
        assert dialect.route_probe is not None and dialect.route_probe.needs


@pytest.mark.parametrize(
    ("weight_sync", "flags", "env"),
    [
        ("vllm_reload", [], {"VLLM_SERVER_DEV_MODE": "1"}),
        (
            "vllm_lora",
            ["--enable-lora", "--max-loras", "3", "--max-lora-rank", "8"],
            {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"},
        ),
        ("vllm_push", ["--weight-transfer-config", '{"backend": "orch_gloo"}'], {"VLLM_SERVER_DEV_MODE": "1"}),
        ("none", [], {}),
    ],
)
def test_a_launched_server_gets_its_dialects_flags_and_environment(tmp_path, monkeypatch, weight_sync, flags, env):
    for name in ("VLLM_SERVER_DEV_MODE", "VLLM_ALLOW_RUNTIME_LORA_UPDATING"):
        monkeypatch.delenv(name, raising=False)
    launch = LaunchSection(servers=1, max_lora_rank=8, extra_args=["--enforce-eager"])
    launcher = VllmLauncher(launch, tmp_path, tmp_path / "run", weight_sync, 3)
    [server] = launcher.servers
    command = launcher.command(server)
    assert command[command.index("processed_logprobs") + 1 :] == [*flags, "--enforce-eager"]
    environment = launcher.environment(server)
    assert {
        k: environment[k] for k in ("VLLM_SERVER_DEV_MODE", "VLLM_ALLOW_RUNTIME_LORA_UPDATING") if k in environment
    } == env


def test_a_lora_server_restarted_under_calls_in_flight_leaves_its_new_state_clean():
    """The calls in flight on the old process count down the old adapters, not the new ones."""
    import asyncio
    from types import SimpleNamespace

    dialect = DIALECTS["vllm_lora"]

    async def main():
        ep = SimpleNamespace(sync=dialect.new_state())
        lost = ep.sync
        with dialect.in_flight(ep, 3):
            dialect.server_lost(ep)
            assert lost.adapter_released.is_set(), "a load waiting for room wakes"
            ep.sync.adapters[3] = 0  # the new process loads version 3 again
        assert ep.sync.adapters == {3: 0} and lost.adapters == {3: 0}

    asyncio.run(main())
