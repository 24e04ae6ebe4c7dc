"""An episode's tokens as text, decoded with the run's own tokenizer (`orch replay --episode ID
--text`, the `text` column of `orch export`'s episodes; docs/observe.md).

The run's tokenizer is the one its trainer published with its weights (the newest
`weights/step_N/` holding tokenizer files: every full fine-tuning run writes step_0), else its
stored `model.path`'s (a Hub id: its snapshot in the Hugging Face cache, never downloaded); a
`--tokenizer DIR` given by hand comes first. Text is decoded as the
samplers decode a completion for the env's score (special tokens skipped).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

import orjson

TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json")
_STEP = re.compile(r"step_(\d+)")


class NoTokenizer(ValueError):
    """The run's tokenizer cannot be found or loaded (one line: where it looked)."""


def tokenizer_dir(run_dir: Path, stored_config: bytes | str | None) -> Path:
    """Where the run's tokenizer is (NoTokenizer naming the places looked in if nowhere)."""
    looked = []
    weights = run_dir / "weights"
    steps = sorted(
        (int(m.group(1)), d) for d in (weights.iterdir() if weights.is_dir() else ()) if (m := _STEP.fullmatch(d.name))
    )
    for _step, directory in reversed(steps):
        if any((directory / name).is_file() for name in TOKENIZER_FILES):
            return directory
    looked.append(f"{weights}/step_N")
    model_path = (orjson.loads(stored_config).get("model") or {}).get("path") if stored_config else None
    if model_path:
        from orchestrator.model_path import ModelError, resolve_model_path

        try:  # a Hub id: its snapshot in the Hugging Face cache, never downloaded here
            directory = resolve_model_path(Path(model_path), local_only=True)
        except ModelError:
            directory = Path(model_path)
        if any((directory / name).is_file() for name in TOKENIZER_FILES):
            return directory
        looked.append(f"model.path {model_path}")
    raise NoTokenizer(f"no tokenizer of {run_dir} found (looked in {', '.join(looked)}); give one with --tokenizer DIR")


def run_decoder(run: Path, stored_config: bytes | str | None, tokenizer: Path | None = None) -> Decoder:
    """The `Decoder` of run `run` (its directory or its events.db): `tokenizer` if given, else the
    run's own (NoTokenizer, one line, if there is none or it does not load)."""
    run_dir = run if run.is_dir() else run.parent
    return Decoder(tokenizer if tokenizer is not None else tokenizer_dir(run_dir, stored_config))


class Decoder:
    """Token ids to text with one tokenizer."""

    def __init__(self, directory: Path):
        from transformers import AutoTokenizer
        from transformers.utils import logging

        logging.set_verbosity_error()
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(str(directory))
        except Exception as err:  # noqa: BLE001 - damaged tokenizer files raise anything (KeyError, the Rust's own)
            reason = (str(err).splitlines() or [""])[0]
            raise NoTokenizer(f"the tokenizer in {directory} does not load ({type(err).__name__}: {reason})") from None
        self.directory = directory

    def decode(self, token_ids: Sequence[int]) -> str:
        text = self.tokenizer.decode(list(token_ids), skip_special_tokens=True)
        assert isinstance(text, str)  # one sequence of ids decodes to one string
        return text

    def completion_text(self, token_ids: Sequence[int], mask: Sequence[int] | bytes) -> str:
        """The sampled tokens alone (what the model said, the env's turns between left out)."""
        return self.decode([token for token, flag in zip(token_ids, mask) if flag])

    def texts(self, token_ids: Sequence[int], mask: Sequence[int] | bytes) -> dict[str, str]:
        """`prompt_text`: the tokens before the first sampled one; `completion_text`: as
        `completion_text()`."""
        first = next((i for i, sampled in enumerate(mask) if sampled), len(token_ids))
        return {"prompt_text": self.decode(token_ids[:first]), "completion_text": self.completion_text(token_ids, mask)}
