"""Pure formatters of the core's state that the shell's progress display and replay's summaries
share (here, below both: replay does not import the shell)."""

from __future__ import annotations


def eval_result_dict(r) -> dict:
    """An eval's result (`EvalResult`) as the summaries show it."""
    return {
        "env": r.env,
        "version": r.version,
        "reward_mean": r.reward_mean,
        "pass_at_1": r.pass_at_1,
        "pass_at_k": r.pass_at_k,
        "k": r.k,
        "scored": r.scored,
        "tokens": r.tokens,
    }


def eval_figures_line(r) -> str:
    """`reward 0.612 | pass@1 0.250 | pass@4 0.500 | 32 scored, 1234 tokens` from an eval's result
    (the `eval_completed` event or its summary dict)."""
    get = r.get if isinstance(r, dict) else lambda name: getattr(r, name)

    def fig(value) -> str:
        return "-" if value is None else f"{value:.3f}"

    return (
        f"reward {fig(get('reward_mean'))} | pass@1 {fig(get('pass_at_1'))} "
        f"| pass@{get('k')} {fig(get('pass_at_k'))} "
        f"| {get('scored')} scored, {get('tokens')} tokens"
    )
