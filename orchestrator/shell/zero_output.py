"""Why a run stopped for zero output (rule 5's guard, docs/rules.md): what the episodes and groups
since the last group admitted for training were doing, told in the stop line with what would
change it."""

from __future__ import annotations

from dataclasses import dataclass, field

from orchestrator.core import events as ev
from orchestrator.core.state import DROP_REASONS

NO_SAMPLE_ERROR = "env: the episode yielded no sample (an ok episode without token ids)"


@dataclass
class ZeroOutputWitness:
    """Since the run last admitted a group: the episodes' outcomes; the groups that settled
    unadmitted, whether each one's rewards tied, and the range of their rewards; the groups
    cancelled, and samples dropped, as stale."""

    scored: int = 0  # ok episodes with sampled tokens
    unsampled: int = 0  # episodes that came back without a sampled token (ok, or failed for it)
    failed: int = 0  # the other failed episodes
    last_error: str | None = None
    tied: int = 0  # groups settled unadmitted whose scored rewards were all equal
    lone: int = 0  # ... of them, those with one scored episode (the rest of the group failed)
    untied: int = 0  # ... whose rewards differed, every advantage zero all the same
    without_output: int = 0  # ... with no scored episode
    judged: int = 0  # the scored episodes of the tied and untied groups
    low: float | None = None  # their lowest reward
    high: float | None = None
    stale_groups: int = 0  # groups cancelled as stale (their survivors too old to train)
    stale_samples: int = 0  # completed samples dropped as stale (`Accounting.dropped["stale"]`'s growth)
    # [lowest, highest, scored episodes] of each group not yet settled or cancelled
    _groups: dict[int, list] = field(default_factory=dict)

    def saw(self, episode: ev.EpisodeCompleted) -> None:
        if (episode.ok and not episode.sampled_tokens) or episode.error == NO_SAMPLE_ERROR:
            self.unsampled += 1
        elif episode.ok:
            self.scored += 1
            group = self._groups.get(episode.group_id)
            if group is None:
                self._groups[episode.group_id] = [episode.reward, episode.reward, 1]
            else:
                group[0], group[1], group[2] = (
                    min(group[0], episode.reward),
                    max(group[1], episode.reward),
                    group[2] + 1,
                )
        else:
            self.failed += 1
            self.last_error = episode.error

    def decided(self, decision: object) -> None:
        """A decision of the core: a group settled (an admitted one starts the tally anew) or
        cancelled, or traces dropped."""
        if isinstance(decision, ev.GroupSettled):
            group = self._groups.pop(decision.group_id, None)
            if decision.admitted:
                self._restart()
                return
            self.stale_samples += len(decision.dropped.get("stale", ()))
            if group is None:
                self.without_output += 1
                return
            low, high, scored = group
            self.tied += low == high
            self.lone += scored == 1
            self.untied += low != high
            self.judged += scored
            self.low = low if self.low is None else min(self.low, low)
            self.high = high if self.high is None else max(self.high, high)
        elif isinstance(decision, ev.GroupCancelled):
            self._groups.pop(decision.group_id, None)
            if decision.reason == "stale":
                self.stale_groups += 1
                self.stale_samples += decision.count
        elif isinstance(decision, ev.TracesDropped) and decision.reason == "stale":
            self.stale_samples += len(decision.trace_ids)

    def _restart(self) -> None:
        self.scored = self.unsampled = self.failed = self.judged = 0
        self.tied = self.lone = self.untied = self.without_output = self.stale_groups = self.stale_samples = 0
        self.low = self.high = self.last_error = None

    def cause(self, group_size: int, zero_output_batches: int) -> str:
        """The stop line's cause (docs/rules.md: no survivors, all-zero advantages, or cancelled as
        stale): no episode sampled a token, every episode failed (the last error), every group's
        rewards were equal (the rewards seen and the settings that change that; not said where the
        failures left no group two scored episodes, or outnumber the scored ones: then the failures
        are the cause), or the groups' fates, stale cancellations first."""
        failed = f"{self.failed} failed (the last: {self.last_error})"
        waits = f"zero_output_batches ({zero_output_batches}) is how long a run waits for one"
        if not self.scored and self.unsampled:
            also = f"; {failed}" if self.failed else ""
            return (
                f"no tokens sampled: {self.unsampled} of the last {self.unsampled + self.failed} episodes came back "
                f"without a sampled token{also} (docs/rules.md, Samples)"
            )
        if not self.scored and self.failed and not self.tied + self.untied + self.stale_groups + self.stale_samples:
            return f"every one of the last {self.failed} episodes failed; the last: {self.last_error}"
        stale = self.stale_groups or self.stale_samples
        # each group kept one scored episode at most: its rewards had none to differ from
        none_to_compare = group_size > 1 and self.tied == self.lone and not self.untied
        if self.failed and not stale and (none_to_compare or self.failed > self.scored):
            # the failures are the cause, whatever the few scored episodes' groups did
            total = self.scored + self.unsampled + self.failed
            left = "no group two scored episodes to compare" if none_to_compare else f"{self.scored} scored"
            return f"{self.failed} of the last {total} episodes failed, leaving {left}; the last: {self.last_error}"
        others = "".join(
            f"; {text}"
            for n, text in ((self.unsampled, f"{self.unsampled} sampled no token"), (self.failed, failed))
            if n
        )
        if self.tied and not (self.untied or stale):
            assert self.low is not None and self.high is not None
            seen = (
                f"reward {self.low:.3f} in every one"
                if self.low == self.high
                else f"rewards {self.low:.3f}..{self.high:.3f}, equal within each group,"
            )
            change = (
                "groups of one episode have none to differ from: raise rollout.group_size"
                if group_size == 1
                else "rewards differ within a group with a model that solves some tasks and not others (a "
                "warm-started model.path), a larger rollout.group_size or a higher rollout.temperature"
            )
            return (
                f"every group's rewards were equal, so every advantage was zero and no group was admitted for "
                f"training ({seen} of the last {self.judged} scored episodes{others}): {change}; {waits}"
            )
        fates = [
            text
            for n, text in (
                (self.stale_groups, f"{self.stale_groups} groups cancelled as stale"),
                (self.stale_samples, f"{self.stale_samples} completed samples dropped as stale"),
                (self.tied, f"{self.tied} groups whose rewards were equal"),
                (self.untied, f"{self.untied} groups whose rewards differed, every advantage zero all the same"),
                (self.without_output, f"{self.without_output} groups left without survivors"),
            )
            if n
        ]
        if not fates:
            return "no episode completed"
        change = (
            f"the work was too old to train once scored: {DROP_REASONS['stale']}"
            if stale
            else "see the groups' rewards and the algorithm's advantages (orch replay RUN --episode)"
        )
        seen = f" (rewards {self.low:.3f}..{self.high:.3f})" if self.low is not None and self.high is not None else ""
        return (
            f"no group was admitted for training since the last one: {', '.join(fates)}{seen}{others}: "
            f"{change}; {waits}"
        )
