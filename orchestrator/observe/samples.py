"""A few of each shipped step's samples as text, for the metric sinks that show text (TensorBoard's
text tab, a W&B table): the step's batch's first `metrics.samples_per_step` samples, in batch
order, each its prompt and completion decoded with the run's tokenizer (`observe.text`) and its
reward (docs/observe.md, "Metric sinks").

The feeder folds the log in order; `StepSamples` keeps where each episode's completion is (its
seq), so that a shipped step's samples are read back by seq, their token arrays only then.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from eventlog import EventLog, PayloadDroppedError
from orchestrator.core.events import EpisodeCompleted, decode_event, episode_of
from orchestrator.core.samples import Sample, split_episode
from orchestrator.core.state import State
from orchestrator.notices import warn
from orchestrator.observe.text import Decoder, NoTokenizer, tokenizer_dir


def waiting_episodes(state: State) -> set[int]:
    """The completed episodes that may still ship: queued, or held by a group being scored."""
    return {episode_of(trace_id) for trace_id in state.pending} | {
        episode for group in state.groups.values() for episode in group.members
    }


@dataclass(frozen=True)
class SampleText:
    """One shipped sample as a person reads it."""

    sample_id: int  # its id in the batch file (`trace_id`) and in `orch replay --episode`
    reward: float
    prompt: str
    completion: str


@dataclass(frozen=True)
class Shipped:
    """A fold item: step `step` shipped; its first samples are `sample_ids`."""

    step: int
    sample_ids: list[int]


@dataclass(frozen=True)
class Completed:
    """A fold item: an episode's completion was logged (at the seq the fold gives it)."""

    episode_id: int


class StepSamples:
    """Picks each shipped step's first `per_step` samples while the log is folded (`take`), and
    reads them back as text (`texts`)."""

    def __init__(self, per_step: int, run_dir: Path, stored_config: str | None):
        self.per_step = per_step
        self.run_dir, self.stored_config = run_dir, stored_config
        self.completed_at: dict[int, int] = {}  # episode id -> seq of its last completion, to the ship after its own
        self._decoder: Decoder | None = None
        self._no_tokenizer = False

    def take(self, event, state: State) -> list[Shipped | Completed]:
        """The fold items of `event`, `state` the run's after it (the feeder records a
        completion's seq with `completed`)."""
        if event.kind == "episode_completed":
            return [Completed(event.episode_id)]
        if event.kind == "batch_shipped":
            shown = event.sample_ids[: self.per_step]
            self._keep_only({episode_of(sample_id) for sample_id in shown} | waiting_episodes(state))
            return [Shipped(event.step, shown)]
        return []

    def _keep_only(self, episodes: set[int]) -> None:
        """Forget where the other episodes' completions are: shipped, or never to train."""
        self.completed_at = {episode: seq for episode, seq in self.completed_at.items() if episode in episodes}

    def completed(self, episode_id: int, seq: int) -> None:
        self.completed_at[episode_id] = seq

    def texts(self, log: EventLog, shipped: Shipped) -> list[SampleText]:
        """`shipped`'s samples as text (none if the run has no tokenizer: said once)."""
        decoder = self.decoder()
        if decoder is None:
            return []
        # where they are is forgotten at the next ship (`take`), when they no longer wait
        seqs = (self.completed_at.get(episode_of(sample_id)) for sample_id in shipped.sample_ids)
        wanted = sorted({seq for seq in seqs if seq is not None})
        try:
            payloads = log.read_payloads(wanted)
        except PayloadDroppedError:  # a sink catching up on steps whose arrays were dropped (log.token_arrays)
            return []
        episodes: dict[int, EpisodeCompleted | Sample] = {}  # by sample id
        for seq in wanted:
            for _seq, _ts, kind, data in log.read_raw(seq, seq):
                event = decode_event(kind, data, payloads.get(seq))
                assert isinstance(event, EpisodeCompleted)  # the seq of an episode_completed
                episodes.update((sample.trace_id, sample) for sample in split_episode(event))
        out = []
        for sample_id in shipped.sample_ids:
            sample = episodes.get(sample_id)
            if sample is not None:
                texts = decoder.texts(sample.token_ids, sample.mask)
                out.append(SampleText(sample_id, sample.reward, texts["prompt_text"], texts["completion_text"]))
        return out

    def decoder(self) -> Decoder | None:
        """The run's tokenizer, found at the first step that needs it (an hf trainer publishes it
        with its first weights); None, said once, if the run has none."""
        if self._decoder is None and not self._no_tokenizer:
            try:
                self._decoder = Decoder(tokenizer_dir(self.run_dir, self.stored_config))
            except NoTokenizer as err:
                self._no_tokenizer = True
                warn(f"the metric sinks show no sample completions: {err}")
        return self._decoder
