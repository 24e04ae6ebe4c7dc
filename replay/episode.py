"""`orch replay RUN --episode ID`: an episode's completion with its token arrays, as JSON.

The log keeps a trace's token ids, mask and logprobs packed in its row's payload
(docs/log-format.md); this reads the rows of that episode (their JSON first, then only their
payloads) and writes them back as lists. An episode of several training samples also lists them
(`training_samples`: each one's id, agent, reward, versions and its slice of the arrays), and ID
may name one of its samples (the id a batch file's `trace_id` gives).
"""

from __future__ import annotations

from pathlib import Path

from eventlog import EventLog
from orchestrator.core.events import EpisodeCompleted, decode_event, episode_of, with_arrays
from orchestrator.core.samples import Sample, split_episode
from replay.source import ReplayInputError, guarded, one_line, row_data

SAMPLE_FIELDS = {"reward", "policy_start", "policy_end", "token_versions", "token_ids", "mask", "logprobs"}


def episode_completions(log: EventLog, episode_id: int) -> list[dict]:
    """Every `episode_completed` of `episode_id` (or of the episode a sample id names) in log
    order, each its fields (arrays as lists), its `seq` and, with several samples, its
    `training_samples`; ReplayInputError (one line) for a row whose payload does not decode."""
    episode_id = episode_of(episode_id)
    rows = []
    for seq, _ts, _kind, data in guarded(log.read_raw(kinds=("episode_completed",)), log.path):
        if row_data(seq, data, log.path).get("episode_id") == episode_id:
            rows.append((seq, data))
    payloads = log.read_payloads([seq for seq, _data in rows])
    out = []
    for seq, data in rows:
        try:
            event = decode_event("episode_completed", data, payloads.get(seq))
        except ValueError as err:
            raise ReplayInputError(
                one_line(f"{log.path}: seq {seq}: cannot decode episode {episode_id}: {err}")
            ) from None
        assert isinstance(event, EpisodeCompleted)  # the kind it was decoded as
        fields = {"seq": seq, **with_arrays(event)}
        if event.samples:
            fields["training_samples"] = [
                {
                    "sample_id": sample.sample_id,
                    "agent": sample.agent,
                    **{name: value for name, value in with_arrays(sample).items() if name in SAMPLE_FIELDS},
                }
                for sample in split_episode(event)
                if isinstance(sample, Sample)
            ]
        out.append(fields)
    return out


def with_text(completions: list[dict], run: Path, stored_config: str | None, tokenizer: Path | None) -> list[dict]:
    """`completions` (as `episode_completions` gives them), each with its `prompt_text` and
    `completion_text` (and each training sample's) decoded with the run's tokenizer, or
    `tokenizer`; ReplayInputError (one line) if there is none."""
    from orchestrator.observe.text import NoTokenizer, run_decoder

    try:
        decoder = run_decoder(run, stored_config, tokenizer)
    except NoTokenizer as err:
        raise ReplayInputError(str(err)) from None
    out = []
    for completion in completions:
        fields = {**completion, **decoder.texts(completion["token_ids"], completion["mask"])}
        if "training_samples" in fields:
            fields["training_samples"] = [
                {**sample, **decoder.texts(sample["token_ids"], sample["mask"])}
                for sample in fields["training_samples"]
            ]
        out.append(fields)
    return out
