"""The model a run trains: a local Hugging Face model dir, its tokenizer and how prompts become ids.

`model.path` names the dir (config.json + weights + tokenizer files); without one, a run trains
the tiny reverse_text model (:mod:`.tiny_model`), built once and cached by its build parameters.
Prompts are rendered here, once, into the token ids sent to the sampler: an env's chat messages
through the tokenizer's chat template, plain text as its tokens. Completions come back as token
ids with their logprobs and are never re-tokenized.

Everything checked before a run starts raises :class:`ModelError` with a one-line message. The
module imports transformers only inside the functions that need it.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from orchestrator.contracts import PreparedModel
from orchestrator.model_path import ModelError, resolve_model_path

# A tiny-model dir is rebuilt when any of these change; the version moves when its recipe does.
TINY_MODEL_RECIPE = "tiny-llama-reverse-text-v1"
WEIGHT_SUFFIXES = (".safetensors", ".bin")


def check_model_dir(path: str | os.PathLike) -> Path:
    """`path` if it looks like a Hugging Face causal-LM dir (config.json with a model_type, and
    weight files), else ModelError saying what is missing."""
    path = Path(path)
    if not path.is_dir():
        raise ModelError(f"model.path {path} is not a directory (a local Hugging Face model dir is expected)")
    config = path / "config.json"
    try:
        doc = json.loads(config.read_text())
    except FileNotFoundError:
        raise ModelError(f"model.path {path} is not a Hugging Face model dir: it has no config.json") from None
    except (OSError, ValueError) as err:
        raise ModelError(f"model.path {path}: config.json does not parse ({err})") from None
    if not isinstance(doc, dict) or "model_type" not in doc:
        raise ModelError(f"model.path {path}: config.json has no model_type (not a transformers model config)")
    if not any(p.name.endswith(WEIGHT_SUFFIXES) for p in path.iterdir()):
        raise ModelError(f"model.path {path} holds no weights (*.safetensors or *.bin)")
    return path


def model_dir_hash(path: str | os.PathLike) -> str:
    """sha256 over the dir's files (relative names and contents, in name order): a resumed run
    checks that the model it started from is still the one at model.path."""
    root = Path(path)
    digest = hashlib.sha256()
    for file in sorted(p for p in root.rglob("*") if p.is_file()):
        digest.update(str(file.relative_to(root)).encode() + b"\0")
        with open(file, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
        digest.update(b"\0")
    return digest.hexdigest()


def quiet_transformers() -> None:
    """No progress bars (a weight load per version would fill the logs with them)."""
    from transformers.utils import logging

    logging.disable_progress_bar()


def load_tokenizer(path: str | os.PathLike):
    from transformers import AutoTokenizer

    quiet_transformers()
    try:
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as err:
        raise ModelError(f"model.path {path}: its tokenizer does not load ({str(err).splitlines()[0]})") from None


def load_model(path: str | os.PathLike):
    """AutoModelForCausalLM from `path`, in fp32 (the trainer's master weights)."""
    import torch
    from transformers import AutoModelForCausalLM

    quiet_transformers()
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)


def check_chat_template(tokenizer, path: str | os.PathLike) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise ModelError(f"model.path {path}: the env gives chat messages, but the tokenizer has no chat template")


def render_prompt(tokenizer, prompt: str, messages: list[dict] | None, **template_kwargs) -> list[int]:
    """The prompt's token ids: `messages` through the chat template (the assistant's turn opened;
    `template_kwargs` are the template's extra variables), else the text's tokens (no special
    tokens added)."""
    if messages is not None:
        return list(
            tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=False, **template_kwargs
            )
        )
    return tokenizer.encode(prompt, add_special_tokens=False)


def check_lora_targets(model, target_modules: list[str], path: str | os.PathLike) -> None:
    """ModelError unless each target names modules of `model` (PEFT matches a name's last part)."""
    leaves = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    unknown = [t for t in target_modules if t not in leaves]
    if unknown:
        linear = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if type(m).__name__ == "Linear"})
        raise ModelError(
            f"trainer.hf.lora.target_modules {unknown}: the model at {path} has no such modules "
            f"(its linear layers: {linear})"
        )


def tiny_model_dir(cache_root: str | os.PathLike, seed: int = 0, target_reward: float = 0.5) -> Path:
    """Where the tiny model built with these parameters is cached."""
    key = hashlib.sha256(f"{TINY_MODEL_RECIPE}/{seed}/{target_reward}".encode()).hexdigest()[:12]
    return Path(cache_root) / f"tiny-model-{key}"


def ensure_tiny_model(cache_root: str | os.PathLike, seed: int = 0, target_reward: float = 0.5, log=print) -> Path:
    """The cached tiny model dir, built (with its warm start) on first use. The build writes a
    temp sibling renamed into place, so a crash mid-build leaves no half model behind."""
    from orchestrator.hf.tiny_model import build_tiny_model
    from orchestrator.rundir import atomic_write_dir

    dest = tiny_model_dir(cache_root, seed, target_reward)
    if dest.is_dir():
        return dest
    log(f"orch: building the tiny reverse_text model (with its warm start) into {dest}")
    try:
        atomic_write_dir(
            dest, lambda tmp: build_tiny_model(tmp, seed=seed, target_reward=target_reward, log=lambda line: None)
        )
    except FileExistsError:  # another run built it meanwhile
        pass
    return dest


def prepare_model(
    path: Path | None, cache_root: Path, *, env_gives_messages: bool, lora_targets: list[str] | None, log=print
) -> PreparedModel:
    """The run's model dir, checked before anything runs: `path` (a Hub id: from the Hugging Face
    cache, `resolve_model_path`), or the tiny model (built and
    cached under `cache_root` on first use); an HF model dir whose tokenizer loads (with a chat
    template if the env gives messages) and whose modules include the LoRA targets. Hashed, so
    a resume can tell whether it changed."""
    path = check_model_dir(
        resolve_model_path(path, log) if path is not None else ensure_tiny_model(cache_root, log=log)
    )
    tokenizer = load_tokenizer(path)
    if env_gives_messages:
        check_chat_template(tokenizer, path)
    if lora_targets is not None:
        check_lora_targets(skeleton(path), lora_targets, path)
    return PreparedModel(path, model_dir_hash(path))


def skeleton(path: Path):
    """The model's modules without its weights (on the meta device: instant at any size)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(str(path))
    except (OSError, ValueError) as err:
        raise ModelError(f"model.path {path}: config.json does not load ({str(err).splitlines()[0]})") from None
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)
