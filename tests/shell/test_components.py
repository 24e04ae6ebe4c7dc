"""Components chosen by name: registries, their config sections, what each supports, the parts."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from typing import ClassVar

import pytest
from pydantic import Field, ValidationError

from orchestrator.algorithms.gar import GAR
from orchestrator.algorithms.grpo import GRPO
from orchestrator.config import (
    ALGORITHMS,
    ENVS,
    INFERENCE,
    RESUMABLE_FIELDS,
    TRAINERS,
    ConfigError,
    Registry,
    _TrainerChoice,
    _with_components,
    load_config,
)
from orchestrator.contracts import Algorithm, AlgorithmComponent, InferenceBackend, Trainer, TrainerComponent
from orchestrator.core.advantages import INLINE_SCORERS
from orchestrator.core.events import CoreParams
from orchestrator.inference.fake import FakeEpisodes
from orchestrator.trainers.fake import FakeTrainer
from tests.support.parts import parts_of

FAKE = ['envs={"fake": 1}', "trainer.kind=fake"]
OWN = " (or a 'module:Attribute' of your own)"


@pytest.mark.parametrize(
    "override, message",
    [
        ("trainer.kind=nope", "trainer.kind: unknown trainer 'nope'; known: fake, hf" + OWN),
        (
            "inference.kind=nope",
            "inference.kind: unknown inference backend 'nope'; known: embedded, fake, openai" + OWN,
        ),
        ("algorithm.name=nope", "algorithm.name: unknown algorithm 'nope'; known: gar, grpo" + OWN),
        (
            'envs={"nope": 1}',
            "envs: unknown env 'nope'; known: dataset, fake, nemo_gym, reasoning_gym, reverse_text, verifiers" + OWN,
        ),
        ("trainer.fake.nope=1", "trainer.fake.nope: no such key"),
        ("trainer.lora.rank=16", "trainer.lora: no such key (did you mean trainer.hf.lora?)"),
        ("trainer.lr=0.1", "trainer.lr: no such key (did you mean trainer.hf.lr?)"),
        ("batch.sise=64", "batch.sise: no such key (did you mean batch.size?)"),
    ],
)
def test_an_unknown_name_is_one_line_listing_the_known_ones(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(overrides=[*FAKE, override])
    assert str(err.value) == f"invalid config: {message}"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ['envs={"fake": 1}'],
            "the hf trainer learns the model's own tokens, not the fake env's; use trainer.kind='fake' for it",
        ),
        (
            ["trainer.kind=fake"],
            "the embedded sampler samples from the trainer's published weights, which the fake "
            "trainer never writes; use trainer.kind='hf' (or the fake env)",
        ),
        (["inference.kind=fake"], "inference.kind='fake' makes the fake env's episodes only"),
        (
            ['inference.openai.endpoints=["http://127.0.0.1:9"]', "inference.openai.weight_sync=vllm_push"]
            + ["trainer.hf.lora.rank=8"],
            "the openai backend (inference.openai) takes each version pushed from the trainer (weight_sync "
            "'vllm_push'), which the hf trainer cannot do: trainer.hf.lora trains adapters, which vLLM loads "
            "from the weights dir as adapters, not pushed (weight_sync 'vllm_lora')",
        ),
        (
            ["inference.openai.launch.servers=1", "inference.openai.weight_sync=vllm_push"]
            + ["trainer.hf.push.transport=nccl"],
            "the openai backend (inference.openai) takes each version pushed from the trainer (weight_sync "
            "'vllm_push'), which the hf trainer cannot do: trainer.hf.push.transport is 'nccl', but the servers "
            "orch launches receive over gloo (no inference.openai.launch.gpus): set it to 'gloo' or 'auto'",
        ),
        (
            ["inference.openai.launch.servers=1", 'inference.openai.launch.gpus=["0"]']
            + ["inference.openai.weight_sync=vllm_push", "trainer.hf.push.transport=gloo"],
            "the openai backend (inference.openai) takes each version pushed from the trainer (weight_sync "
            "'vllm_push'), which the hf trainer cannot do: trainer.hf.push.transport is 'gloo', but the servers "
            "orch launches receive over nccl (inference.openai.launch.gpus): set it to 'nccl' or 'auto'",
        ),
        (
            ["inference.kind=openai"],
            "inference.kind='openai' needs inference.openai.endpoints, routers or launch.servers",
        ),
    ],
)
def test_each_component_checks_what_it_supports(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(overrides=overrides)
    assert str(err.value) == f"invalid config: {message}"


def test_the_fake_env_needs_its_own_episode_source():
    """Not reachable through today's other components (each refuses the fake env first), but
    stated by the env itself for the next sampler."""
    config = load_config(overrides=FAKE)
    elsewhere = config.model_copy(update={"inference": config.inference.model_copy(update={"kind": "embedded"})})
    config.env.fake.check(config.plan())
    with pytest.raises(
        ValueError,
        match=r"^the fake env's episodes come whole from inference.kind='fake', not "
        r"'embedded'$",
    ):
        elsewhere.env.fake.check(elsewhere.plan())


def test_every_registered_component_has_its_own_section():
    dumped = load_config().model_dump()
    for section, registry in (
        ("trainer", TRAINERS),
        ("inference", INFERENCE),
        ("env", ENVS),
        ("algorithm", ALGORITHMS),
    ):
        for name in registry.names():
            assert dumped[section][name] == registry.config(name)().model_dump(), (section, name)


def test_the_inference_backend_is_chosen_as_before_unless_named():
    assert load_config().inference_kind() == "embedded"
    assert load_config(overrides=FAKE).inference_kind() == "fake"
    assert load_config(overrides=['inference.openai.endpoints=["http://a:1"]']).inference_kind() == "openai"


def test_components_name_the_fields_a_resume_may_change():
    assert {"trainer.fake.step_time_s", "trainer.hf.nproc", "inference.openai.endpoints"} <= RESUMABLE_FIELDS
    assert "env.reverse_text.server" in RESUMABLE_FIELDS
    assert "trainer.hf.lr" not in RESUMABLE_FIELDS and "env.fake.latency_s" not in RESUMABLE_FIELDS


def test_the_env_server_is_reverse_text_s_own_setting():
    with pytest.raises(ConfigError) as err:
        load_config(overrides=["rollout.env_server=http://127.0.0.1:9"])
    assert str(err.value) == (
        "invalid config: rollout: env_server is now env.reverse_text.server (the reverse_text env's own setting)"
    )


class LoudConfig(AlgorithmComponent):
    """An algorithm of a module of its own: GRPO's advantages, louder, scored in the background."""

    gain: float = 2.0

    def build(self, ctx):
        return GRPO()


class InlineWithoutScorerConfig(LoudConfig):
    """Declares inline scoring, which needs a scorer of the core's that it has not."""

    finalize_in_background: ClassVar[bool] = False


def test_an_algorithm_is_its_section_and_the_run_asks_it_nothing_by_name():
    """The run's core params come from the chosen section alone: its flag, its core settings."""
    loud = load_config(overrides=[*FAKE, f"algorithm.name={__name__}:LoudConfig"]).core_params()
    assert (loud.algorithm, loud.finalize_in_background, loud.std_normalization) == (
        f"{__name__}:LoudConfig",
        True,
        False,
    )
    normalized = load_config(overrides=[*FAKE, "algorithm.grpo.std_normalization=true"]).core_params()
    assert (normalized.algorithm, normalized.finalize_in_background, normalized.std_normalization) == (
        "grpo",
        False,
        True,
    )
    with pytest.raises(ConfigError) as err:
        load_config(overrides=[*FAKE, f"algorithm.name={__name__}:InlineWithoutScorerConfig"])
    assert str(err.value) == (
        f"invalid config: algorithm '{__name__}:InlineWithoutScorerConfig' is not one the core scores inline "
        "(grpo): it must finalize in the background"
    )


def test_every_built_in_algorithm_declared_inline_has_the_core_s_scorer():
    for name, section in ALGORITHMS.configs().items():
        assert section.__module__ == f"orchestrator.algorithms.{name}"
        assert section.finalize_in_background or name in INLINE_SCORERS, name
        assert set(section().core_settings()) <= set(CoreParams.model_fields), name


class ProbeTrainerConfig(TrainerComponent):
    """A trainer added by a module of its own."""

    resumable: ClassVar[frozenset[str]] = frozenset({"depth"})
    depth: int = Field(2, ge=1, description="how deep it probes")

    def check(self, run) -> None:
        if self.depth > 3:
            raise ValueError("the probe trainer probes at most 3 deep")

    def build(self, ctx):  # it trains as the fake trainer does: the test is about its config section
        from orchestrator.trainers.fake import FakeTrainerConfig

        return FakeTrainerConfig().build(ctx)


def test_a_component_added_to_a_table_gets_its_section_validated():
    registry = Registry(
        "trainer", {"fake": "orchestrator.trainers.fake:FakeTrainerConfig", "probe": f"{__name__}:ProbeTrainerConfig"}
    )
    section = _with_components("TrainerSection", _TrainerChoice, registry)
    chosen = section.model_validate({"kind": "fake", "probe": {"depth": 3}})
    assert isinstance(chosen.probe, ProbeTrainerConfig) and chosen.probe.depth == 3
    assert isinstance(section().probe, ProbeTrainerConfig)  # its defaults, like every section's
    assert section.model_fields["probe"].description == "A trainer added by a module of its own."
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        section.model_validate({"probe": {"width": 1}})


def test_the_fake_parts_are_built_from_the_config_and_follow_the_interfaces(tmp_path):
    parts = parts_of(
        load_config(
            overrides=[*FAKE, f"runs_dir={tmp_path}", "name=r", "algorithm.name=gar", "trainer.fake.step_time_s=0.5"]
        )
    )
    assert isinstance(parts.trainer, FakeTrainer) and parts.trainer.step_time_s == 0.5
    assert isinstance(parts.backend, FakeEpisodes) and not parts.backend.follows_weights
    assert isinstance(parts.algorithm, GAR)
    assert isinstance(parts.trainer, Trainer) and isinstance(parts.backend, InferenceBackend)
    assert isinstance(parts.algorithm, Algorithm)


def test_a_fake_run_imports_neither_torch_nor_httpx(tmp_path):
    script = textwrap.dedent(f"""
        import sys
        from orchestrator.config import load_config
        from orchestrator.shell.compose import run_job
        from orchestrator.shell.runner import create_run
        run = create_run(load_config(overrides=['envs={{"fake": 1}}', "trainer.kind=fake", "max_steps=2",
                                                "batch.size=8", "runs_dir={tmp_path}", "name=r"]))
        with run.log:
            assert run_job(run, None).state.stop_reason == "completed"
        print(sorted(m for m in ("torch", "httpx", "transformers") if m in sys.modules))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
