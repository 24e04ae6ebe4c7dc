"""The user docs: the generated configuration reference is current, and no link leaves the repository."""

from __future__ import annotations

import re
from pathlib import Path

from orchestrator import config_docs

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\]\(([^)\s]+)\)")


def user_docs() -> list[Path]:
    top = [ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "bench" / "README.md"]
    return top + sorted((ROOT / "docs").glob("*.md"))


def test_the_configuration_reference_is_generated_from_the_current_config():
    committed = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert committed == config_docs.render(), f"docs/configuration.md is stale: run `{config_docs.COMMAND}`"


def test_every_config_field_has_a_description():
    assert config_docs.undescribed_fields() == []


def test_the_reference_lists_every_leaf_field_once():
    text = config_docs.render()
    keys = re.findall(r"^\| `([a-z_.]+)` \|", text, flags=re.MULTILINE)
    assert len(keys) == len(set(keys))
    assert {"seed", "batch.size", "algorithm.gar.rank_weight", "inference.openai.endpoints"} <= set(keys)
    assert "rollout" not in keys and "algorithm.gar" not in keys  # sections are headings, not rows


def test_links_in_the_docs_point_to_files_inside_the_repository():
    for doc in user_docs():
        for target in LINK.findall(doc.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+://|#|mailto:", target):
                continue
            path = (doc.parent / target.split("#")[0]).resolve()
            assert path.is_relative_to(ROOT), f"{doc.relative_to(ROOT)} links outside the repository: {target}"
            assert path.exists(), f"{doc.relative_to(ROOT)} links to a missing file: {target}"


def test_make_verifiers_says_that_pips_torchaudio_error_is_expected():
    import subprocess

    dry = subprocess.run(  # what `make verifiers` would run in a fresh venv, nothing run
        ["make", "-n", "VENV=/nonexistent-venv", "/nonexistent-venv/.installed-verifiers"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=30,
    )
    recipe = dry.stdout
    note = recipe.index("requires torchaudio")
    assert "expected, those were removed on purpose" in recipe
    assert note < recipe.index("pip install --progress-bar on -e '.[verifiers]'")
