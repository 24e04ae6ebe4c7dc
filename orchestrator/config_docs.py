"""The configuration reference, generated from `RunConfig`'s fields and their descriptions.

    python -m orchestrator.config_docs > docs/configuration.md

`tests/test_docs.py` fails when the committed file differs from what this prints.
"""

from __future__ import annotations

import sys
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import orjson
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from orchestrator.config import RESUMABLE_FIELDS, RunConfig

COMMAND = "python -m orchestrator.config_docs > docs/configuration.md"

HEADER = f"""\
# Configuration reference

<!-- generated from orchestrator/config.py by `{COMMAND}`; do not edit by hand -->

Every knob of a run is a field of `orchestrator/config.py:RunConfig`. Set them in a TOML file
(`orch run --config FILE.toml`, sections as TOML tables) or one by one with a dotted
`--set KEY=VALUE` (the value parses as JSON, else it is a string), e.g.

```
orch run --set batch.size=64 --set algorithm.name=gar --set 'envs={{"fake": 1}}' --set trainer.kind=fake
```

```toml
max_steps = 100
[batch]
size = 64
[off_policy]
max_off_policy_steps = 4
```

Defaults below are written as `--set` takes them (JSON). "On resume": a field that *may change*
can be given a new value with `orch run --resume RUN_DIR --set ...`; a *fixed* one changes what the
run computes, so a resume that changes it is refused (exit 2, naming the field). `max_steps` may
not go below the batches already shipped.
"""


def _is_section(field: FieldInfo) -> bool:
    return isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)


def describe_section(model: type[BaseModel], field: FieldInfo | None) -> str:
    if field is not None and field.description:
        return field.description
    return " ".join((model.__doc__ or "").split())


def type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return " \\| ".join(f"`{orjson.dumps(a).decode()}`" for a in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(type_name(a) for a in typing.get_args(annotation))
    if annotation is type(None):
        return "null"
    if origin is not None:
        return f"{origin.__name__}[{', '.join(type_name(a).strip('`') for a in typing.get_args(annotation))}]"
    if annotation is Path:
        return "path"
    return annotation.__name__


def bounds(field: FieldInfo) -> str:
    signs = {"ge": "≥", "gt": ">", "le": "≤", "lt": "<"}
    return ", ".join(
        f"{sign} {getattr(item, attr)}"
        for item in field.metadata
        for attr, sign in signs.items()
        if hasattr(item, attr)  # annotated_types.Ge and its kin
    )


def default_text(field: FieldInfo) -> str:
    value = field.get_default(call_default_factory=True)
    if isinstance(value, Path):
        value = str(value)
    return f"`{orjson.dumps(value).decode()}`"


def render() -> str:
    lines = [HEADER]
    for dotted, section, fields in _walk(RunConfig, ""):
        if not fields:
            continue
        lines.append(f"## `{dotted}`" if dotted else "## Top level")
        lines.append("")
        if section:
            lines += [section[0].upper() + section[1:].rstrip(".") + ".", ""]
        lines += ["| key | type | default | range | on resume | description |", "|---|---|---|---|---|---|"]
        for name, field in fields:
            key = f"{dotted}.{name}" if dotted else name
            resume = "may change" if key in RESUMABLE_FIELDS else "fixed"
            description = (field.description or "").replace("|", "\\|")
            lines.append(
                f"| `{key}` | {type_name(field.annotation)} | {default_text(field)} | {bounds(field)} "
                f"| {resume} | {description} |"
            )
        lines.append("")
    return "\n".join(lines)


def _walk(model: type[BaseModel], dotted: str, field: FieldInfo | None = None) -> Iterator[tuple[str, str, list]]:
    """(dotted section name, its description, its leaf fields) for `model`, then its sections."""
    leaves = [(n, f) for n, f in model.model_fields.items() if not _is_section(f)]
    yield dotted, describe_section(model, field), leaves
    for name, child in model.model_fields.items():
        if _is_section(child):
            yield from _walk(typing.cast(type[BaseModel], child.annotation), f"{dotted}.{name}".lstrip("."), child)


def undescribed_fields() -> list[str]:
    """Dotted keys of the leaf fields that have no description (the reference would show a blank)."""
    return [
        f"{dotted}.{name}".lstrip(".")
        for dotted, _, fields in _walk(RunConfig, "")
        for name, field in fields
        if not field.description
    ]


if __name__ == "__main__":
    sys.stdout.write(render())
