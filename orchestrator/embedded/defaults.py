"""Recommended settings for the embedded reverse_text run (no torch import; safe for the core).

Measured with :mod:`orchestrator.embedded.simulate` (lag 1, seeds 0-3, 2 shared CPU cores):
40 steps take ~20-40 s including the warm start, and mean reward of the last 5 steps beats the first
5 by +0.30..+0.43 (lr 2e-3). :class:`~orchestrator.embedded.trainer.TrainerConfig` defaults use
these values; the orchestrator side should use the sampling ones.
"""

# orchestrator side
GROUP_SIZE = 8
GROUPS_PER_STEP = 16  # batch_size = GROUP_SIZE * GROUPS_PER_STEP = 128 traces (before pruning)
BATCH_SIZE = GROUP_SIZE * GROUPS_PER_STEP
TARGET_LAG = 1  # measured with lag 1 (sample step N with version N-2) as well as lag 0
TEMPERATURE = 1.0
MAX_NEW_TOKENS = 48  # the longest correct answer is 15 + 6 + 16 + EOS = 38 tokens

# trainer side
MAX_STEPS = 40
LR = 2e-3
LR_WARMUP_STEPS = 5
CLIP_EPS = 0.2
SFT_STOP_LOSS = 0.12  # warm start stops at ~0.5 reward: partial, leaves room for RL
KEEP_WEIGHTS = 3
