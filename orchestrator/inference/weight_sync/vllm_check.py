"""Before a run samples given vLLM endpoints (a dialect of engine "vllm"): each serves the run's
model and has the routes of the weight sync (its dialect's `route_probe`)."""

from __future__ import annotations

from pathlib import Path

from orchestrator.inference.errors import InferenceRequestError, Retryable
from orchestrator.inference.protocol import GENERATE_PATH
from orchestrator.inference.weight_sync.base import EndpointT, RouteProbe, WeightSyncClient


async def check_vllm_endpoints(client: WeightSyncClient[EndpointT], model_dir: Path) -> None:
    """InferenceRequestError (one line) if a reachable endpoint serves another model than
    ``model_dir`` (or ``model``, when given), or lacks the routes of this weight sync. One not
    reachable yet is left to the weight loads, which wait for endpoints that are starting."""
    probe = client.dialect.route_probe
    assert probe is not None, "every dialect of engine vllm names its route_probe"
    for ep in client.endpoints:
        try:
            listed = await client.call(ep, "GET", "/v1/models")
        except Retryable:
            continue
        bases = (
            [m for m in listed.get("data", []) if isinstance(m, dict) and m.get("parent") is None]
            if isinstance(listed, dict)
            else []
        )
        names = {str(m.get(key)) for m in bases for key in ("id", "root")}
        if not (client.model in names or any(_same_path(name, model_dir) for name in names)):
            served = ", ".join(sorted(names)) or repr(listed)[:200]
            hint = "" if client.model else " (set inference.openai.model to its served name)"
            raise InferenceRequestError(
                f"{ep.url} serves {served}, not this run's model {client.model or model_dir}" + hint
            )
        for url in ep.admin_urls:  # a router's engines, each
            try:
                await client.call(ep, probe.method, probe.path, probe.body, text=probe.text, base=url)
            except InferenceRequestError as exc:
                if exc.status_code != 404 or "cannot be found" not in str(exc):  # "cannot be found": the route is there
                    raise _lacks(client, url, probe, exc) from None
            except Retryable as exc:
                if probe.unset is not None and probe.unset in str(exc):
                    raise _lacks(client, url, probe, exc) from None
                continue
        if client.update_mode == "keep":
            await check_generate_route(client, ep)


async def check_generate_route(client: WeightSyncClient[EndpointT], ep: EndpointT) -> None:
    """update_mode keep samples on the token-in, token-out route: a GET there answers 405 (it is a
    POST route) where the server has it, 404 where it was started without --enable-scale-out."""
    try:
        await client.call(ep, "GET", GENERATE_PATH)
    except InferenceRequestError as exc:
        if exc.status_code == 405:
            return
        raise InferenceRequestError(
            f"{ep.url} lacks {GENERATE_PATH} ({exc}): update_mode 'keep' samples there "
            "(vLLM started with --enable-scale-out)"
        ) from None
    except Retryable:
        return  # not reachable yet: left to the weight loads, as above


def _lacks(client: WeightSyncClient, url: str, probe: RouteProbe, exc: Exception) -> InferenceRequestError:
    return InferenceRequestError(
        f"{url} lacks {probe.path} ({exc}): weight_sync {client.weight_sync!r} needs vLLM started with {probe.needs}"
    )


def _same_path(name: str, path: Path) -> bool:
    try:
        return Path(name).resolve() == Path(path).resolve()
    except (OSError, ValueError):
        return False
