"""A deterministic simulated world around the pure core: no asyncio, no files, no clock.

It plays the outside world (env completions, background finalize results, trainer publishes)
with a seeded RNG and feeds the core one input at a time, keeping the logged stream. Tests,
property tests, the replay equivalence matrix and the core benchmark all drive the real
`decide`/`evolve` through it.

`settle="immediate"` delivers each background finalize result right after its
`finalize_started` (before any other input); `settle="random"` holds results and delivers them
later in random order, like slow graders would. The world is an effect port: the effect
interpreter (orchestrator.effects) tells it what each decision calls for.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from orchestrator.core import events as ev
from orchestrator.core.advantages import grpo_advantages
from orchestrator.core.arrays import Tokens
from orchestrator.core.decide import decide
from orchestrator.core.state import Group, State, initial_state
from orchestrator.effects import IgnoringPort, perform


@dataclass
class SimOptions:
    error_rate: float = 0.05
    empty_rate: float = 0.03
    min_tokens: int = 1
    max_tokens: int = 12
    publish_weight: float = 0.15  # relative chance the trainer publishes when it can
    settle: str = "immediate"  # or "random"
    deliver_weight: float = 0.3  # relative chance a held finalize result is delivered
    reward_levels: int = 4  # rewards are k / reward_levels, so ties (zero advantages) happen
    eval_weight: float = 1.0  # relative chance an in-flight eval episode completes
    eval_off_version_rate: float = 0.0  # chance an eval sample comes from another version than its pin
    max_samples: int = 1  # training samples per episode: drawn from 1..max_samples (docs/rules.md, Samples)
    agent_rewards: bool = False  # several-sample episodes alternate two agents, each scored apart


class SimWorld(IgnoringPort):
    def __init__(
        self,
        params: ev.CoreParams,
        seed: int = 0,
        options: SimOptions | None = None,
        scorer: Callable[[list[float]], list[float]] | None = None,
        state: State | None = None,
    ):
        self.params, self.options = params, options or SimOptions()
        self.scorer = scorer or (lambda rewards: grpo_advantages(rewards, params.std_normalization))
        self.rng = random.Random(seed)
        self.started = state is not None  # a given state has had its run_started
        self.state = state or initial_state(params)
        self.log: list[ev.Event] = []
        self.held_results: list[ev.BackgroundFinalized] = []
        self.dispatch_version: dict[int, int] = {}
        self.eval_pins: dict[int, int] = {}  # eval episode -> the version it is pinned to

    def feed(self, event: ev.Event) -> list[ev.Event]:
        """Hand one input to the core; log it with its decisions; perform what they call for."""
        decisions = decide(self.state, event)
        self.log.append(event)
        self.log.extend(decisions)
        perform(self.state, [event, *decisions], self)
        return decisions

    # --- the effect port: the world answers rollouts and background finalizes; the rest (no
    # files, no inference, a trainer that publishes on its own schedule) needs nothing of it. A
    # held result of a cancelled group is still delivered, late, as a slow grader's would be.

    def start_rollout(self, dispatched: ev.EpisodeDispatched, group: Group) -> None:
        self.dispatch_version[dispatched.episode_id] = dispatched.policy_version

    def start_eval_rollout(self, dispatched: ev.EvalEpisodeDispatched) -> None:
        self.eval_pins[dispatched.episode_id] = dispatched.policy_version

    def start_finalize(self, started: ev.FinalizeStarted, episodes: list[ev.EpisodeCompleted]) -> None:
        result = ev.BackgroundFinalized(
            group_id=started.group_id,
            episode_ids=started.episode_ids,
            advantages=self.scorer([e.reward for e in episodes]),
        )
        if self.options.settle == "immediate":
            self.feed(result)
        else:
            self.held_results.append(result)

    def start(self) -> None:
        self.started = True
        self.feed(ev.RunStarted(params=self.params))

    def completion(self, episode_id: int, ok: bool | None = None) -> ev.EpisodeCompleted:
        """A seeded result for an in-flight episode."""
        o, rng = self.options, self.rng
        group_id = self.state.inflight[episode_id]
        start = self.dispatch_version.get(episode_id, self.state.version)
        if ok is None:
            ok = rng.random() >= o.error_rate
        if not ok:
            return ev.EpisodeCompleted(
                episode_id=episode_id,
                group_id=group_id,
                ok=False,
                reward=0.0,
                temperature=1.0,
                policy_start=start,
                policy_end=self.state.version,
                error="sim: env error",
            )
        if o.max_samples > 1:
            count = rng.randint(1, o.max_samples)
            if count > 1:
                return self._several_samples(episode_id, group_id, start, count)
        prompt = rng.randint(1, 4)
        sampled = 0 if rng.random() < o.empty_rate else rng.randint(o.min_tokens, o.max_tokens)
        n = prompt + sampled
        return ev.EpisodeCompleted(
            episode_id=episode_id,
            group_id=group_id,
            ok=True,
            temperature=1.0,
            reward=rng.randint(0, o.reward_levels) / o.reward_levels,
            tokens=Tokens.of(
                [rng.randrange(256) for _ in range(n)],
                [0] * prompt + [1] * sampled,
                [0.0] * prompt + [-rng.random() for _ in range(sampled)],
            ),
            policy_start=start,
            policy_end=self.state.version,
        )

    def _several_samples(self, episode_id: int, group_id: int, start: int, count: int) -> ev.EpisodeCompleted:
        """An episode of `count` samples, each sampled by one version between the episode's
        start and now (later samples by later versions), some possibly without sampled tokens."""
        o, rng, end = self.options, self.rng, self.state.version
        token_ids, mask, logprobs, samples, runs = [], [], [], [], []
        versions = sorted(rng.randint(start, end) for _ in range(count))
        for version in versions:
            prompt = rng.randint(1, 4)
            sampled = 0 if rng.random() < o.empty_rate else rng.randint(o.min_tokens, o.max_tokens)
            token_ids += [rng.randrange(256) for _ in range(prompt + sampled)]
            mask += [0] * prompt + [1] * sampled
            logprobs += [0.0] * prompt + [-rng.random() for _ in range(sampled)]
            samples.append((prompt + sampled, sampled))
            runs.append((version, sampled))
        sampled_versions = [v for v, n in runs if n]
        agents = tuple("ab"[i % 2] for i in range(count)) if o.agent_rewards else ()
        return ev.EpisodeCompleted(
            episode_id=episode_id,
            group_id=group_id,
            ok=True,
            temperature=1.0,
            reward=rng.randint(0, o.reward_levels) / o.reward_levels,
            tokens=Tokens.of(token_ids, mask, logprobs),
            policy_start=min(sampled_versions, default=start),
            policy_end=max(sampled_versions, default=start),
            token_versions=ev.version_runs(runs),
            samples=tuple(samples),
            agents=agents,
            agent_rewards=tuple((a, rng.randint(0, o.reward_levels) / o.reward_levels) for a in dict.fromkeys(agents)),
        )

    def eval_completion(self, episode_id: int, ok: bool | None = None) -> ev.EvalEpisodeCompleted:
        """A seeded result for an in-flight eval episode; success is reward 1 (as in reverse_text)."""
        o, rng = self.options, self.rng
        pin = self.eval_pins[episode_id]
        version = pin + 1 if rng.random() < o.eval_off_version_rate else pin
        if ok is None:
            ok = rng.random() >= o.error_rate
        reward = rng.randint(0, o.reward_levels) / o.reward_levels if ok else 0.0
        return ev.EvalEpisodeCompleted(
            episode_id=episode_id,
            eval_id=self.state.evals.inflight[episode_id],
            ok=ok,
            reward=reward,
            success=reward == 1.0 if ok else None,
            sampled_tokens=rng.randint(o.min_tokens, o.max_tokens) if ok else 0,
            policy_start=version,
            policy_end=version,
            error=None if ok else "sim: env error",
        )

    def actions(self) -> list[tuple[str, float]]:
        s, o = self.state, self.options
        acts = []
        if s.inflight:
            acts.append(("complete", 1.0))
        if s.evals.inflight:  # never with evals off: the draws of a run without evals are unchanged
            acts.append(("complete_eval", o.eval_weight))
        if s.version < s.step - 1:
            acts.append(("publish", o.publish_weight))
        if self.held_results:
            acts.append(("deliver", o.deliver_weight))
        return acts

    def advance(self) -> bool:
        """Take one seeded action; False when nothing can happen any more."""
        acts = self.actions()
        if self.state.stopped or not acts:
            return False
        total = sum(w for _, w in acts)
        pick, running = self.rng.random() * total, 0.0
        for name, weight in acts:  # noqa: B007 - the loop stops at the picked action, read below
            running += weight
            if pick < running:
                break
        if name == "complete":
            inflight = list(self.state.inflight)
            self.feed(self.completion(inflight[self.rng.randrange(len(inflight))]))
        elif name == "complete_eval":
            inflight = list(self.state.evals.inflight)
            self.feed(self.eval_completion(inflight[self.rng.randrange(len(inflight))]))
        elif name == "publish":
            self.feed(ev.VersionPublished(version=self.state.version + 1))
        else:
            self.feed(self.held_results.pop(self.rng.randrange(len(self.held_results))))
        return True

    def run(self, max_actions: int = 1_000_000) -> State:
        if not self.started:
            self.start()
        for _ in range(max_actions):
            if not self.advance():
                break
        return self.state


class TimedSimWorld(SimWorld):
    """The simulated world on a clock of integer ticks: each episode finishes a seeded number of
    ticks after its dispatch (uniform in `latency`, so a straggler is bounded as a sampler's
    length cap bounds it), and the trainer takes `train_ticks` per step, one step at a time,
    starting each once its batch has shipped. The earliest thing due happens next (completions,
    train or eval, before a publish due at the same tick). Background finalize results settle
    immediately."""

    def __init__(
        self,
        params: ev.CoreParams,
        seed: int = 0,
        options: SimOptions | None = None,
        latency: tuple[int, int] = (1, 9),
        train_ticks: int = 5,
    ):
        super().__init__(params, seed, options)
        self.latency, self.train_ticks = latency, train_ticks
        self.tick = 0
        self.due: dict[int, int] = {}  # in-flight episode id -> tick it finishes
        self.publish_at: int | None = None  # tick the trainer publishes the step it trains

    def feed(self, event) -> list:
        decisions = super().feed(event)
        for decision in decisions:
            if decision.kind in ("episode_dispatched", "eval_episode_dispatched"):
                self.due[decision.episode_id] = self.tick + self.rng.randint(*self.latency)
        self._start_training()
        return decisions

    def _start_training(self) -> None:
        s = self.state
        if self.publish_at is None and s.version < s.step - 1 and not s.stopped:
            self.publish_at = self.tick + self.train_ticks

    def advance(self) -> bool:
        s = self.state
        if s.stopped:
            return False
        for episode_id in [e for e in self.due if e not in s.inflight and e not in s.evals.inflight]:  # cancelled
            del self.due[episode_id]
        next_episode = min(self.due, key=lambda e: (self.due[e], e), default=None)
        if next_episode is not None and (self.publish_at is None or self.due[next_episode] <= self.publish_at):
            self.tick = max(self.tick, self.due.pop(next_episode))
            train = next_episode in s.inflight
            self.feed(self.completion(next_episode) if train else self.eval_completion(next_episode))
        elif self.publish_at is not None:
            self.tick, self.publish_at = max(self.tick, self.publish_at), None
            self.feed(ev.VersionPublished(version=s.version + 1))
        else:
            return False
        return True
