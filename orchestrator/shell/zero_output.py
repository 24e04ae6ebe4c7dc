"""Why a run stopped for zero output (rule 3's guard, docs/rules.md): what the episodes since the
last group admitted for training were doing, told in the stop line with what would change it."""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.core import events as ev

NO_SAMPLE_ERROR = "env: the episode yielded no sample (an ok episode without token ids)"


@dataclass
class ZeroOutputWitness:
    """The episodes completed since the run last admitted a group (`Accounting.groups_admitted`
    moved): their outcomes, and the range of the scored ones' rewards."""

    admitted: int = 0  # groups_admitted when the tally started
    scored: int = 0  # ok episodes with sampled tokens
    unsampled: int = 0  # episodes that came back without a sampled token (ok, or failed for it)
    failed: int = 0  # the other failed episodes
    low: float | None = None
    high: float | None = None
    last_error: str | None = None

    def saw(self, episode: ev.EpisodeCompleted, groups_admitted: int) -> None:
        if groups_admitted != self.admitted:  # something was admitted since: the tally starts anew
            self.admitted, self.scored, self.unsampled, self.failed = groups_admitted, 0, 0, 0
            self.low = self.high = self.last_error = None
        if (episode.ok and not episode.sampled_tokens) or episode.error == NO_SAMPLE_ERROR:
            self.unsampled += 1
        elif episode.ok:
            self.scored += 1
            self.low = episode.reward if self.low is None else min(self.low, episode.reward)
            self.high = episode.reward if self.high is None else max(self.high, episode.reward)
        else:
            self.failed += 1
            self.last_error = episode.error

    def cause(self, group_size: int, zero_output_batches: int) -> str:
        """The stop line's cause: no episode sampled a token, every episode failed (the last
        error), or every group's rewards were equal (the rewards seen and the settings that change
        that)."""
        failed = f"{self.failed} failed (the last: {self.last_error})"
        if not self.scored and self.unsampled:
            also = f"; {failed}" if self.failed else ""
            return (
                f"no tokens sampled: {self.unsampled} of the last {self.unsampled + self.failed} episodes came back "
                f"without a sampled token{also} (docs/rules.md, Samples)"
            )
        if not self.scored and self.failed:
            return f"every one of the last {self.failed} episodes failed; the last: {self.last_error}"
        if not self.scored:
            return "no episode completed"
        assert self.low is not None and self.high is not None
        seen = (
            f"reward {self.low:.3f} in every one"
            if self.low == self.high
            else f"rewards {self.low:.3f}..{self.high:.3f}, equal within each group,"
        )
        others = "".join(
            f"; {text}"
            for n, text in ((self.unsampled, f"{self.unsampled} sampled no token"), (self.failed, failed))
            if n
        )
        change = (
            "groups of one episode have none to differ from: raise rollout.group_size"
            if group_size == 1
            else "rewards differ within a group with a model that solves some tasks and not others (a warm-started "
            "model.path), a larger rollout.group_size or a higher rollout.temperature"
        )
        return (
            f"every group's rewards were equal, so every advantage was zero and no group was admitted for training "
            f"({seen} of the last {self.scored} scored episodes{others}): {change}; "
            f"zero_output_batches ({zero_output_batches}) is how long a run waits for one"
        )
