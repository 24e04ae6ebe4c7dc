"""`orch serve`'s policy: a tiny char-level causal language model, its sampler and its weight files.

Everything runs on the CPU. Sequences are ``prompt_ids + completion_ids`` as rendered by
:mod:`orchestrator.serve.tokenizer`; the model is causal, so right padding (PAD) never changes
the logits of earlier positions.

Log-probabilities are always those of the temperature-scaled distribution
``log_softmax(logits / temperature)``: the sampler records them per sampled token and the trainer
recomputes them with :func:`token_logprobs` on the same sequence; at equal weights both agree to
float32 precision (the importance ratio is then 1).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from orchestrator import rundir as files
from orchestrator.serve.tokenizer import BOS, EOS, PAD, SEP, VOCAB_SIZE, decode, encode_prompt


class PolicyConfig(BaseModel):
    """Shape of the policy network. ``arch`` picks a causal transformer (default) or a GRU."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    arch: Literal["transformer", "gru"] = "transformer"
    vocab_size: int = Field(VOCAB_SIZE, description="must equal tokenizer.VOCAB_SIZE")
    d_model: int = Field(64, ge=8, description="embedding width (transformer) / hidden size (gru)")
    layers: int = Field(2, ge=1, le=8)
    heads: int = Field(4, ge=1, description="transformer only")
    d_ff: int = Field(128, ge=8, description="transformer only")
    max_prompt: int = Field(32, ge=2, description="longest prompt in tokens, BOS..SEP (transformer only)")
    max_len: int = Field(96, ge=8, description="longest prompt + completion (transformer only)")


class _Block(nn.Module):
    """Pre-LN transformer block with an optional key/value cache for incremental decoding."""

    def __init__(self, c: PolicyConfig):
        super().__init__()
        if c.d_model % c.heads:
            raise ValueError(f"policy: d_model {c.d_model} is not divisible by heads {c.heads}")
        self.heads = c.heads
        self.ln1 = nn.LayerNorm(c.d_model)
        self.qkv = nn.Linear(c.d_model, 3 * c.d_model)
        self.proj = nn.Linear(c.d_model, c.d_model)
        self.ln2 = nn.LayerNorm(c.d_model)
        self.ff = nn.Sequential(nn.Linear(c.d_model, c.d_ff), nn.ReLU(), nn.Linear(c.d_ff, c.d_model))

    def forward(self, x: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor] | None):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        if cache is not None:
            k, v = torch.cat([cache[0], k], 2), torch.cat([cache[1], v], 2)
        if cache is None or t > 1:
            # causal over the new positions, all cached positions visible
            s = k.shape[2]
            allowed = torch.ones(t, s, dtype=torch.bool).tril(s - t)
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        else:
            a = F.scaled_dot_product_attention(q, k, v)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.ff(self.ln2(x)), (k, v)


class TinyTransformer(nn.Module):
    """Causal transformer whose positions are counted from the prompt's SEP token.

    Position of token t = t - index(SEP) (+ ``max_prompt`` to index the table): the k-th answer
    character sits at a fixed offset from the prompt character it copies, whatever the prompt
    length, which makes reversal (and the closing tag) length-independent.
    State for incremental decoding: (per-layer key/value cache, SEP index per row, next position).
    """

    def __init__(self, c: PolicyConfig):
        super().__init__()
        if c.max_prompt >= c.max_len:
            raise ValueError(f"policy: max_prompt {c.max_prompt} must be < max_len {c.max_len}")
        self.c = c
        self.tok = nn.Embedding(c.vocab_size, c.d_model)
        self.pos = nn.Embedding(c.max_len, c.d_model)
        self.blocks = nn.ModuleList(_Block(c) for _ in range(c.layers))
        self.ln = nn.LayerNorm(c.d_model)

    def forward(self, ids: torch.Tensor, state):
        t = ids.shape[1]
        if state is None:
            sep = (ids == SEP).to(torch.int64).argmax(1)  # first SEP (0 if none: garbage, in range)
            start, caches = 0, [None] * len(self.blocks)
        else:
            caches, sep, start = state
        pos = torch.arange(start, start + t).unsqueeze(0) - sep.unsqueeze(1) + (self.c.max_prompt - 1)
        if int(pos.min()) < 0 or int(pos.max()) >= self.c.max_len:
            raise ValueError(
                f"policy: sequence does not fit the position table (prompt <= {self.c.max_prompt} "
                f"tokens, prompt + completion <= {self.c.max_len})"
            )
        x = self.tok(ids) + self.pos(pos)
        new_caches = []
        for blk, cache in zip(self.blocks, caches):
            x, kv = blk(x, cache)
            new_caches.append(kv)
        return self.ln(x), (new_caches, sep, start + t)


class _GRUBody(nn.Module):
    def __init__(self, c: PolicyConfig):
        super().__init__()
        self.emb = nn.Embedding(c.vocab_size, c.d_model)
        self.rnn = nn.GRU(c.d_model, c.d_model, num_layers=c.layers, batch_first=True)

    def forward(self, ids: torch.Tensor, state):
        return self.rnn(self.emb(ids), state)


class Policy(nn.Module):
    """Causal char-level LM: body (transformer or GRU) -> linear head.

    ``forward(ids [B, T], state=None) -> (logits [B, T, V], state)``: ``state`` carries the
    prefix (transformer: per-layer key/value cache; GRU: hidden state) so decoding is incremental.
    PAD/BOS/SEP can never be produced (their logits are -inf).
    """

    def __init__(self, config: PolicyConfig):
        super().__init__()
        if config.vocab_size != VOCAB_SIZE:
            raise ValueError(f"policy: vocab_size {config.vocab_size} does not match the tokenizer ({VOCAB_SIZE})")
        self.config = config
        self.body = TinyTransformer(config) if config.arch == "transformer" else _GRUBody(config)
        self.head = nn.Linear(config.d_model, config.vocab_size)
        never = torch.zeros(config.vocab_size)
        never[[PAD, BOS, SEP]] = float("-inf")
        self.register_buffer("logit_mask", never, persistent=False)

    def forward(self, ids: torch.Tensor, state=None):
        out, state = self.body(ids, state)
        return self.head(out) + self.logit_mask, state


def build_policy(config: PolicyConfig | None = None, *, seed: int = 0) -> Policy:
    """A freshly initialised policy; the init depends only on ``seed`` (global RNG untouched)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Policy(config or PolicyConfig())


# ------------------------------------------------------------------------------------- sampling
@dataclass(frozen=True)
class SampledCompletion:
    prompt_ids: list[int]
    completion_ids: list[int]  # sampled tokens, EOS included when it was sampled
    logprobs: list[float]  # one per completion token, under log_softmax(logits / temperature)
    text: str  # decode(completion_ids): what the env scores
    policy_version: int | None = field(default=None)  # set by EmbeddedSampler

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.completion_ids

    @property
    def mask(self) -> list[int]:
        return [0] * len(self.prompt_ids) + [1] * len(self.completion_ids)

    @property
    def full_logprobs(self) -> list[float]:
        """Per-token logprobs aligned with :attr:`token_ids` (0.0 on prompt tokens)."""
        return [0.0] * len(self.prompt_ids) + list(self.logprobs)

    @property
    def finished(self) -> bool:
        return bool(self.completion_ids) and self.completion_ids[-1] == EOS


def sample_group(
    model: Policy,
    prompt: str,
    n: int,
    *,
    temperature: float,
    max_new_tokens: int,
    seed: int,
) -> list[SampledCompletion]:
    """Sample ``n`` completions of ``prompt`` (one batch).

    Deterministic given (weights, prompt, n, temperature, max_new_tokens, seed): the randomness is
    a private ``torch.Generator`` seeded with ``seed``. Each row stops at its first EOS (kept as
    its last token) or after ``max_new_tokens`` tokens. Equivalent to
    ``sample_groups(model, [prompt], n, seeds=[seed], ...)[0]``.
    """
    return sample_groups(model, [prompt], n, temperature=temperature, max_new_tokens=max_new_tokens, seeds=[seed])[0]


def sample_groups(
    model: Policy,
    prompts: list[str],
    n: int,
    *,
    temperature: float,
    max_new_tokens: int,
    seeds: list[int],
) -> list[list[SampledCompletion]]:
    """Sample ``n`` completions for each prompt, batching prompts of equal length together.

    The per-token cost on the CPU is dominated by fixed overheads, so sampling 16 groups in one
    call is several times cheaper than 16 calls. Group k draws its randomness only from its own
    generator (seeded with ``seeds[k]``, one uniform per row and token, inverse-CDF sampling), so
    its completions do not depend on which other groups share the call (up to float rounding of
    batched matmuls).
    """
    if len(seeds) != len(prompts):
        raise ValueError(f"sample_groups: {len(prompts)} prompts but {len(seeds)} seeds")
    encoded = [encode_prompt(p) for p in prompts]
    _check_sampling_args(model, encoded, n, temperature, max_new_tokens)
    out: list[list[SampledCompletion] | None] = [None] * len(prompts)
    buckets: dict[int, list[int]] = {}
    for k, ids in enumerate(encoded):
        buckets.setdefault(len(ids), []).append(k)
    for members in buckets.values():
        rows = _sample_bucket(
            model,
            [encoded[k] for k in members],
            n,
            [torch.Generator().manual_seed(int(seeds[k])) for k in members],
            temperature,
            max_new_tokens,
        )
        for j, k in enumerate(members):
            out[k] = rows[j * n : (j + 1) * n]
    return out  # type: ignore[return-value]


def _check_sampling_args(
    model: Policy, encoded: list[list[int]], n: int, temperature: float, max_new_tokens: int
) -> None:
    if n < 1:
        raise ValueError(f"sample_groups: n must be >= 1, got {n}")
    if not temperature > 0:
        raise ValueError(f"sample_groups: temperature must be > 0, got {temperature}")
    if max_new_tokens < 1:
        raise ValueError(f"sample_groups: max_new_tokens must be >= 1, got {max_new_tokens}")
    c = model.config
    if c.arch == "transformer":
        longest = max((len(e) for e in encoded), default=0)
        if longest > c.max_prompt or max_new_tokens > c.max_len - c.max_prompt + 1:
            raise ValueError(
                f"sample_groups: does not fit the position table: prompt {longest} tokens "
                f"(max_prompt {c.max_prompt}), max_new_tokens {max_new_tokens} "
                f"(at most max_len - max_prompt + 1 = {c.max_len - c.max_prompt + 1})"
            )


@torch.inference_mode()
def _sample_bucket(model, prompt_ids, n, gens, temperature, max_new_tokens) -> list[SampledCompletion]:
    rows = [p for p in prompt_ids for _ in range(n)]
    logits, state = model(torch.tensor(rows, dtype=torch.long))
    last = logits[:, -1]
    done = torch.zeros(len(rows), dtype=torch.bool)
    toks: list[torch.Tensor] = []
    lps: list[torch.Tensor] = []
    for _ in range(max_new_tokens):
        logp = torch.log_softmax(last / temperature, dim=-1)
        cdf = logp.exp().cumsum(-1)
        u = torch.cat([torch.rand(n, 1, generator=g) for g in gens])
        # first index with cdf >= (1-u)*total: always a token of positive probability
        tok = torch.searchsorted(cdf, (1.0 - u) * cdf[:, -1:]).clamp_(max=cdf.shape[1] - 1)
        lp = logp.gather(1, tok).squeeze(1)
        tok = tok.squeeze(1)
        toks.append(torch.where(done, PAD, tok))
        lps.append(lp)
        done = done | (tok == EOS)
        if bool(done.all()):
            break
        logits, state = model(tok.unsqueeze(1), state)
        last = logits[:, -1]
    tok_mat = torch.stack(toks, 1).tolist()
    lp_mat = torch.stack(lps, 1).tolist()
    out = []
    for prompt, row, lrow in zip(rows, tok_mat, lp_mat):
        length = next((i for i, t in enumerate(row) if t == PAD), len(row))
        ids = row[:length]
        out.append(SampledCompletion(list(prompt), ids, lrow[:length], decode(ids)))
    return out


# ------------------------------------------------------------------------ trainer-side logprobs
def token_logprobs(model: Policy, ids: torch.Tensor, temperature: float | torch.Tensor) -> torch.Tensor:
    """Differentiable per-token logprobs, as the trainer computes them.

    ids [B, T] (right-padded with PAD); temperature a float or a [B] tensor. Returns [B, T] where
    position t holds log p(ids[t] | ids[:t]) under ``log_softmax(logits / temperature)``; position
    0 holds 0.0. Values at padded positions are meaningless: mask them.
    """
    logits, _ = model(ids[:, :-1])
    if isinstance(temperature, torch.Tensor):
        logits = logits / temperature.to(logits.dtype).view(-1, 1, 1)
    else:
        logits = logits / float(temperature)
    logp = torch.log_softmax(logits, dim=-1)
    tgt = ids[:, 1:]
    # Targets the model can never produce (PAD padding, SEP/BOS inside the prompt) would give -inf;
    # gather EOS there instead so every value is finite (those positions are masked anyway).
    tgt = torch.where((tgt == PAD) | (tgt == SEP) | (tgt == BOS), EOS, tgt)
    lp = logp.gather(-1, tgt.unsqueeze(-1)).squeeze(-1)
    return F.pad(lp, (1, 0))


def pad_batch(seqs: list[list[int]], pad: int = PAD) -> torch.Tensor:
    width = max(len(s) for s in seqs)
    return torch.tensor([list(s) + [pad] * (width - len(s)) for s in seqs], dtype=torch.long)


@torch.no_grad()
def batch_sequence_logprobs(
    model: Policy, token_ids: list[list[int]], prompt_lens: list[int], temperature: float
) -> list[list[float]]:
    """Recomputed logprobs of the completion tokens (``ids[prompt_len:]``) of each sequence."""
    lp = token_logprobs(model, pad_batch(token_ids), temperature).tolist()
    return [row[p : len(ids)] for row, p, ids in zip(lp, prompt_lens, token_ids)]


def sequence_logprobs(model: Policy, token_ids: list[int], prompt_len: int, temperature: float) -> list[float]:
    """Recomputed logprobs of ``token_ids[prompt_len:]`` (one sequence)."""
    return batch_sequence_logprobs(model, [token_ids], [prompt_len], temperature)[0]


# ---------------------------------------------------------------------------------- weight files
def save_weights(model: Policy, dest: str | os.PathLike) -> Path:
    """Write ``model.pt`` + ``policy.json`` into a new directory ``dest`` atomically (temp dir,
    fsync files, rename). Does NOT write STABLE: the publisher marks it after this returns
    (see :func:`files.mark_stable`). Raises FileExistsError if ``dest`` exists."""
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}

    def write(tmp: Path) -> None:
        torch.save(state, tmp / files.MODEL_FILE)
        (tmp / files.POLICY_FILE).write_bytes(model.config.model_dump_json().encode())

    return files.atomic_write_dir(dest, write)


def load_policy(wdir: str | os.PathLike) -> Policy:
    """Load a policy saved by :func:`save_weights` (CPU, eval mode)."""
    wdir = Path(wdir)
    config = PolicyConfig.model_validate_json((wdir / files.POLICY_FILE).read_bytes())
    model = Policy(config)
    model.load_state_dict(torch.load(wdir / files.MODEL_FILE, map_location="cpu", weights_only=True))
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


# ----------------------------------------------------------------------------------- the sampler
class EmbeddedSampler:
    """The current policy of `orch serve` (orchestrator.serve.server).

    Thread-safe: :meth:`sample_group` may run in worker threads (``asyncio.to_thread``) while
    :meth:`reload` runs in another. A reload loads the new model fully *outside* the lock, then
    swaps the (model, version) pair under the lock; a sampling call takes that pair once, so every
    completion of one call comes from exactly one version, reported in ``policy_version``. Loaded
    models are never mutated, so several samplings may run at once.

    Cost (1 CPU thread, default policy, ~38-token answers): one call costs ~the same for n=1 as
    for n=8, because fixed per-token overheads dominate. 128 episodes sampled one by one take
    ~4.5 s; 16 calls of n=8 ~0.6 s; one :meth:`sample_groups` call ~0.3 s, so callers batch.
    """

    def __init__(self, model: Policy | None = None, version: int = -1):
        self._lock = threading.Lock()
        self._model = model
        self._version = version

    @classmethod
    def from_weights(cls, wdir: str | os.PathLike, version: int) -> EmbeddedSampler:
        s = cls()
        s.reload(wdir, version)
        return s

    @property
    def version(self) -> int:
        with self._lock:
            return self._version

    def reload(self, wdir: str | os.PathLike, version: int, replace: bool = False) -> None:
        """Load ``wdir`` (must be STABLE) and make it current. A version older than the current
        one is ignored (reloads may race) unless ``replace`` (another run's weights); raises if
        the directory is not published."""
        if not files.is_stable(wdir):
            raise FileNotFoundError(f"sampler: {wdir} has no {files.STABLE} marker (not published)")
        model = load_policy(wdir)
        with self._lock:
            if self._model is None or version >= self._version or replace:
                self._model, self._version = model, version

    def current(self) -> tuple[Policy, int]:
        with self._lock:
            if self._model is None:
                raise RuntimeError("sampler: no policy loaded yet (call reload first)")
            return self._model, self._version

    def sample_group(
        self, prompt: str, n: int, *, temperature: float, max_new_tokens: int, seed: int
    ) -> list[SampledCompletion]:
        model, version = self.current()
        outs = sample_group(model, prompt, n, temperature=temperature, max_new_tokens=max_new_tokens, seed=seed)
        return [SampledCompletion(o.prompt_ids, o.completion_ids, o.logprobs, o.text, version) for o in outs]

    def sample_groups(
        self, prompts: list[str], n: int, *, temperature: float, max_new_tokens: int, seeds: list[int]
    ) -> list[list[SampledCompletion]]:
        """Batched :meth:`sample_group` (one version for all); see :func:`sample_groups`."""
        model, version = self.current()
        groups = sample_groups(model, prompts, n, temperature=temperature, max_new_tokens=max_new_tokens, seeds=seeds)
        return [
            [SampledCompletion(o.prompt_ids, o.completion_ids, o.logprobs, o.text, version) for o in g] for g in groups
        ]
