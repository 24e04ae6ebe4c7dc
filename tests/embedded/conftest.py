"""The tests of `orch serve`'s own policy run on 1 torch thread."""

from __future__ import annotations

import warnings

import torch

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
torch.set_num_threads(1)
