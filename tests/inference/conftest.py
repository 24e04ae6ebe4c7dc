from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def base():
    """The tiny reverse_text model dir (warm-started, cached across sessions)."""
    from tests.inference.vllm_util import tiny_model

    return tiny_model()
