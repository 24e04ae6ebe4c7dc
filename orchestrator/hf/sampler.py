"""In-process sampling from an HF model: the embedded default's inference engine.

`sample` is a small decoding loop over the model with its KV cache: left-padded prompts, one
forward pass per new token for the whole batch, each row drawing from its own seeded generator
(so a completion does not depend on the batch it was sampled in, up to float rounding) from the
full temperature-scaled distribution (no top-k/top-p), and reporting the logprob of each drawn
token under that distribution, exactly what the trainer recomputes. With `newer` (update_mode
interrupt) a version published meanwhile takes over between two decode steps: it recomputes
the batch's KV cache (prompt + the tokens so far) and samples the next token, so every token's
version is the one whose forward pass sampled it, given every token before it.

:class:`Sampler` holds the current version (an HF dir, or a PEFT adapter over the base model)
for the rollout worker threads and coalesces their concurrent one-episode requests into one
batch, as an inference server would.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from orchestrator import rundir
from orchestrator.core.events import version_runs
from orchestrator.hf.model import load_model

CPU = torch.device("cpu")


@dataclass(frozen=True)
class Completion:
    token_ids: list[int]  # sampled tokens, the eos included when it was drawn
    logprobs: list[float]  # one per sampled token
    version: int  # of its oldest token
    # update_mode interrupt: (version, tokens) runs where versions took over while it was sampled
    # (`orchestrator.core.events.version_runs`); empty where `version` sampled every token
    token_versions: tuple[tuple[int, int], ...] = ()

    @property
    def newest_version(self) -> int:
        return max((v for v, _ in self.token_versions), default=self.version)


Newer = Callable[[int], "tuple[Any, int] | None"]  # a version newer than the one given: (model, version)


@torch.no_grad()
def sample(
    model,
    prompts: list[list[int]],
    seeds: list[int],
    *,
    temperature: float,
    max_new_tokens: int,
    eos_id: int,
    pad_id: int,
    version: int = 0,
    newer: Newer | None = None,
) -> list[tuple[list[int], list[float], list[int]]]:
    """(completion ids, their logprobs, the version that sampled each) per prompt; a row stops
    at `eos_id` (kept) or the cap. `model` is `version`; `newer`, asked before every decode step
    after the first, gives a newer version to take over."""
    device = next(model.parameters()).device
    rows, width = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((rows, width), pad_id, dtype=torch.long)
    attention = torch.zeros((rows, width), dtype=torch.long)
    for i, prompt in enumerate(prompts):  # left padding: every row continues at the last column
        ids[i, width - len(prompt) :] = torch.tensor(prompt)
        attention[i, width - len(prompt) :] = 1
    ids, attention = ids.to(device), attention.to(device)
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    generators = [torch.Generator().manual_seed(seed & 0x7FFF_FFFF_FFFF_FFFF) for seed in seeds]
    out = model(input_ids=ids, attention_mask=attention, position_ids=positions, use_cache=True)
    past, logits, next_position = out.past_key_values, out.logits[:, -1], positions[:, -1] + 1
    done = torch.zeros(rows, dtype=torch.bool, device=device)
    tokens, logprobs, versions = [], [], []
    for _ in range(max_new_tokens):
        versions.append(version)
        logp = torch.log_softmax(logits.float() / temperature, dim=-1)
        uniforms = torch.stack([torch.rand((), generator=g) for g in generators]).view(-1, 1).to(device)
        cdf = logp.exp().cumsum(-1)
        drawn = torch.searchsorted(cdf, uniforms * cdf[:, -1:]).clamp(max=logp.shape[-1] - 1)
        tokens.append(drawn.view(-1))
        logprobs.append(logp.gather(-1, drawn).view(-1))
        done = done | (drawn.view(-1) == eos_id)
        if bool(done.all()):
            break
        attention = torch.cat([attention, torch.ones((rows, 1), dtype=torch.long, device=device)], dim=1)
        took_over = newer(version) if newer is not None else None
        if took_over is None:
            out = model(
                input_ids=drawn,
                attention_mask=attention,
                position_ids=next_position.view(-1, 1),
                past_key_values=past,
                use_cache=True,
            )
        else:  # the new version's KV of everything so far: its next token is its own, given all before it
            model, version = took_over
            out = model(
                input_ids=torch.cat([ids, torch.stack(tokens, 1)], dim=1),
                attention_mask=attention,
                position_ids=(attention.cumsum(-1) - 1).clamp(min=0),
                use_cache=True,
            )
        past, logits, next_position = out.past_key_values, out.logits[:, -1], next_position + 1
    token_rows, logprob_rows = torch.stack(tokens, 1).tolist(), torch.stack(logprobs, 1).tolist()
    results = []
    for row, lps in zip(token_rows, logprob_rows):
        length = row.index(eos_id) + 1 if eos_id in row else len(row)
        results.append((row[:length], lps[:length], versions[:length]))
    return results


def load_version(wdir: Path, base_path: Path, device: torch.device = CPU):
    """The model of a published version (an HF dir, or a PEFT adapter over the base model) on
    `device`."""
    if (wdir / "adapter_config.json").is_file():
        from peft import PeftModel

        model = PeftModel.from_pretrained(load_model(base_path), str(wdir))
    else:
        model = load_model(wdir)
    return model.to(device).eval()


class Sampler:
    """The current version for rollout worker threads; `sample_coalesced` batches their requests.

    A reload loads the new model outside the lock, then swaps (model, version) under it. Each
    group of a batch (its requests of one temperature and length cap) takes that pair when it
    starts and, with `interrupt`, a newer one between two decode steps (`sample`); each
    completion reports the version of each of its tokens.
    """

    def __init__(
        self,
        base_path: str | os.PathLike,
        eos_id: int,
        pad_id: int,
        device: torch.device = CPU,
        interrupt: bool = False,
    ):
        self.base_path, self.eos_id, self.pad_id, self.device = Path(base_path), eos_id, pad_id, device
        self.interrupt = interrupt
        self._lock = threading.Lock()
        self._model, self._version = None, -1
        self._queue_cv = threading.Condition()
        self._queue: list[_Request] = []
        self._leader_active = False
        self.batches = 0  # batches served (observability, tests)

    @property
    def version(self) -> int:
        with self._lock:
            return self._version

    def reload(self, wdir: str | os.PathLike, version: int) -> None:
        """Make published version `version` current (an older one than the current is ignored:
        reloads may race)."""
        wdir = Path(wdir)
        if not rundir.is_stable(wdir):
            raise FileNotFoundError(f"sampler: {wdir} has no {rundir.STABLE} marker (not published)")
        model = load_version(wdir, self.base_path, self.device)
        with self._lock:
            if version >= self._version:
                self._model, self._version = model, version

    def _newer(self, version: int) -> tuple[Any, int] | None:
        with self._lock:
            return (self._model, self._version) if self._version > version else None

    def sample_coalesced(
        self, prompt_ids: list[int], *, temperature: float, max_new_tokens: int, seed: int
    ) -> Completion:
        """One completion of `prompt_ids`; concurrent callers are sampled in one batch. Blocking
        (worker threads): the first caller to find no batch running leads, samples every pending
        request, hands out the results, and repeats while requests arrived meanwhile."""
        request = _Request(prompt_ids, temperature, max_new_tokens, seed)
        with self._queue_cv:
            self._queue.append(request)
            while self._leader_active and request.result is None:
                self._queue_cv.wait()
            if request.result is not None:
                return request.outcome()
            self._leader_active = True
            batch, self._queue = self._queue, []
        try:
            self._serve(batch)
        finally:
            with self._queue_cv:
                for r in batch:
                    if r.result is None:
                        r.result = RuntimeError("sampler: the batch serving this request was interrupted")
                self._leader_active = False
                self._queue_cv.notify_all()
        return request.outcome()

    def _serve(self, batch: list[_Request]) -> None:
        self.batches += 1
        by_params: dict[tuple[float, int], list[_Request]] = {}
        for r in batch:
            by_params.setdefault((r.temperature, r.max_new_tokens), []).append(r)
        for (temperature, max_new_tokens), requests in by_params.items():
            with self._lock:  # each group starts on the newest version
                model, version = self._model, self._version
            if model is None:
                for r in requests:
                    r.result = RuntimeError("sampler: no version loaded yet")
                continue
            try:
                results = sample(
                    model,
                    [r.prompt_ids for r in requests],
                    [r.seed for r in requests],
                    temperature=temperature,
                    max_new_tokens=max_new_tokens,
                    eos_id=self.eos_id,
                    pad_id=self.pad_id,
                    version=version,
                    newer=self._newer if self.interrupt else None,
                )
            except Exception as exc:  # noqa: BLE001 - each request of the batch gets the error
                for r in requests:
                    r.result = exc
                continue
            for r, (ids, lps, versions) in zip(requests, results):
                runs = version_runs((v, 1) for v in versions)
                r.result = Completion(ids, lps, versions[0], runs)


class _Request:
    __slots__ = ("prompt_ids", "temperature", "max_new_tokens", "seed", "result")

    def __init__(self, prompt_ids: list[int], temperature: float, max_new_tokens: int, seed: int):
        self.prompt_ids, self.temperature = prompt_ids, temperature
        self.max_new_tokens, self.seed = max_new_tokens, seed
        self.result: Completion | BaseException | None = None

    def outcome(self) -> Completion:
        if isinstance(self.result, BaseException):
            raise self.result
        assert self.result is not None
        return self.result
