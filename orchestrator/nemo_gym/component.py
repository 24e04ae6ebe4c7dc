"""`env.nemo_gym`: NeMo Gym agents as an orch env (docs/nemo_gym.md): the section, what it
supports, and its factory (the route, the servers and the env, built only in `open`)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, ClassVar

from orchestrator.contracts import BuildContext, ConfigError, EnvComponent, RunPlan
from orchestrator.nemo_gym.config import (
    NAME,
    NemoGymSettings,
    agent_name,
    load_servers,
    server_directory,
    server_instances,
    split_rows,
)

if TYPE_CHECKING:
    from orchestrator.nemo_gym.env import NemoGymEnv


class NemoGymConfig(EnvComponent, NemoGymSettings):
    """NeMo Gym agents (their /run) on task rows, their model calls through orch's route and inference.openai."""

    gives_messages: ClassVar[bool] = True  # rendered by orch's route with the model's chat template

    resumable: ClassVar[frozenset[str]] = frozenset(
        {"venv", "launch", "agent_url", "route_host", "route_port", "ray_address"}
        | {"ready_timeout_s", "stop_timeout_s", "episode_timeout_s"}
    )

    def check(self, plan: RunPlan) -> None:
        """ValueError (one line) unless the env can run in this run: alone, sampled by the
        `openai` backend, evals only with held-out rows, given servers only with their URL."""
        if set(plan.envs) != {NAME}:
            raise ValueError("env 'nemo_gym' runs alone (its episodes come whole from NeMo Gym's agent)")
        if plan.inference != "openai":
            raise ValueError(
                "env 'nemo_gym' samples through inference.kind='openai' (vLLM started with --enable-scale-out), "
                f"not {plan.inference!r}"
            )
        if NAME in plan.eval_envs and self.held_out is None and not self.held_out_fraction:
            raise ValueError(
                "evals of env 'nemo_gym' need held-out rows: set env.nemo_gym.held_out or held_out_fraction"
            )
        if self.held_out is not None and self.held_out_fraction:
            raise ValueError("env.nemo_gym: give held_out or held_out_fraction, not both")
        if not self.launch and not self.agent_url:
            raise ValueError("env.nemo_gym.launch = false needs env.nemo_gym.agent_url (the agent server you started)")
        if not self.launch and not self.route_port:
            raise ValueError(
                "env.nemo_gym.launch = false needs env.nemo_gym.route_port: the port your servers' config gives "
                f"model server {self.model_server!r}"
            )

    def solved(self, reward: float) -> bool | None:
        return None if self.success_threshold is None else reward >= self.success_threshold

    def preflight(self, seed: int) -> None:
        """Before the run dir exists: the rows read and split, and, where orch starts the servers,
        NeMo Gym's venv found and its config naming one agent that calls orch's route."""
        split_rows(self)
        if not self.launch:
            return
        if not (self.venv / "bin" / "python").exists():
            raise ConfigError(
                f"env.nemo_gym.venv {self.venv}: no Python there (build NeMo Gym's venv with `make nemo-gym`)"
            )
        if self.site_packages() is None or not (self.site_packages() / "nemo_gym").is_dir():
            raise ConfigError(f"env.nemo_gym.venv {self.venv}: NeMo Gym is not installed there (`make nemo-gym`)")
        config = load_servers(self)
        agent_name(self, config)
        for name, (kind, server, own) in server_instances(config).items():
            if name == self.model_server or "entrypoint" not in own:
                continue
            entrypoint = server_directory(self, kind, server) / str(own["entrypoint"])
            if not entrypoint.is_file():
                raise ConfigError(f"NeMo Gym server {name}: no {entrypoint} (its {kind}/{server} is not installed)")

    @contextlib.asynccontextmanager
    async def open(self, ctx: BuildContext) -> AsyncIterator[NemoGymEnv]:
        """orch's route serving, the servers up (where orch starts them), the env for the run."""
        from orchestrator.envs.server import ListenError
        from orchestrator.hf.model import load_tokenizer
        from orchestrator.nemo_gym.config import run_config
        from orchestrator.nemo_gym.env import NemoGymEnv
        from orchestrator.nemo_gym.route import ResponsesRoute
        from orchestrator.nemo_gym.servers import NemoGymServerError, NemoGymServers
        from orchestrator.urls import free_port

        if ctx.model is None:
            raise ValueError("env 'nemo_gym' renders its prompts with the run's prepared model (the hf trainer's)")
        model_dir = ctx.model.path.resolve()
        tokenizer = load_tokenizer(model_dir)
        train, held_out = split_rows(self)
        route = ResponsesRoute(tokenizer, ctx.served_model or str(model_dir), dict(ctx.sampling.chat_template_kwargs))
        async with contextlib.AsyncExitStack() as stack:
            try:
                port = await stack.enter_async_context(route.serving(self.route_host, self.route_port))
            except ListenError as err:
                raise NemoGymServerError(f"orch's NeMo Gym route (env.nemo_gym.route_host/route_port): {err}") from None
            servers, agent_url = None, self.agent_url
            if self.launch:
                config = run_config(self, (self.route_host, port), free_port, self.ray_address)
                servers = NemoGymServers(self, config, ctx.run_dir)
                await stack.enter_async_context(servers.running())
                agent_url = servers.url_of(agent_name(self, config))
            assert agent_url is not None  # check() refused given servers without their agent's URL
            env = NemoGymEnv(
                train=train,
                held_out=held_out,
                seed=ctx.seed,
                temperature=ctx.sampling.temperature,
                max_tokens=ctx.sampling.max_new_tokens,
                agent_url=agent_url,
                route=route,
                episode_timeout_s=self.episode_timeout_s,
                check_servers=servers.check_alive if servers is not None else None,
            )
            stack.push_async_callback(env.aclose)
            yield env
