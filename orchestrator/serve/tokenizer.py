"""Char-level tokenizer of `orch serve`'s policy.

Vocabulary (ids are stable; ``VOCAB_SIZE`` = 4 specials + the sorted characters below):

* ``PAD`` = 0 (right padding in batches; never sampled: its logit is masked out),
  ``BOS`` = 1 (first token of every prompt), ``EOS`` = 2 (ends a completion),
  ``SEP`` = 3 (ends the prompt: "your turn").
* one id per character of the reverse_text alphabet (``"abcdefgh"``) and of the tags
  ``<reversed_text>`` / ``</reversed_text>``.

Rendering (the contract between the sampler, the trainer and the warm start):

* prompt:      ``[BOS] + chars(prompt) + [SEP]``          (:func:`encode_prompt`)
* completion:  ``chars(answer) + [EOS]``                  (:func:`encode_completion`)
* a sequence fed to the model is ``prompt_ids + completion_ids``; the sampled tokens are exactly
  the completion ids (EOS included when it was sampled).

:func:`decode` maps ids back to text, dropping special tokens and stopping at the first EOS, so
``decode(completion_ids)`` is the completion text the env scores.
"""

from __future__ import annotations

from collections.abc import Iterable

from orchestrator.envs.reverse_text import ALPHABET, CLOSE_TAG, OPEN_TAG

PAD, BOS, EOS, SEP = 0, 1, 2, 3
SPECIALS = ("<pad>", "<bos>", "<eos>", "<sep>")
CHARS = "".join(sorted(set(ALPHABET) | set(OPEN_TAG) | set(CLOSE_TAG)))
VOCAB_SIZE = len(SPECIALS) + len(CHARS)

_CHAR_TO_ID = {c: i + len(SPECIALS) for i, c in enumerate(CHARS)}
_ID_TO_CHAR = {i: c for c, i in _CHAR_TO_ID.items()}


class TokenizerError(ValueError):
    pass


def encode(text: str) -> list[int]:
    """Character ids of ``text`` (no specials). Raises :class:`TokenizerError` on an unknown char."""
    try:
        return [_CHAR_TO_ID[c] for c in text]
    except KeyError as exc:
        raise TokenizerError(f"tokenizer: character {exc.args[0]!r} is not in the vocabulary {CHARS!r}") from None


def decode(ids: Iterable[int]) -> str:
    """Text of ``ids``: specials dropped, stops at the first EOS. Raises on an out-of-range id."""
    out = []
    for i in ids:
        i = int(i)
        if i == EOS:
            break
        if 0 <= i < len(SPECIALS):
            continue
        try:
            out.append(_ID_TO_CHAR[i])
        except KeyError:
            raise TokenizerError(f"tokenizer: id {i} is out of range [0, {VOCAB_SIZE})") from None
    return "".join(out)


def encode_prompt(prompt: str) -> list[int]:
    """``[BOS] + chars(prompt) + [SEP]``: what the policy is conditioned on."""
    return [BOS, *encode(prompt), SEP]


def task_prompt_ids(task) -> list[int]:
    """A task's prompt as the policy is conditioned on it (how an endpoints backend renders
    prompts for `orch serve`: `EndpointsBackend(encode_prompt=...)`)."""
    return encode_prompt(task.prompt)


def encode_completion(answer: str) -> list[int]:
    """``chars(answer) + [EOS]``: a full (teacher) completion, as used by the warm start."""
    return [*encode(answer), EOS]
