"""Where a component's config model comes from: the one resolver behind every registry of
`orchestrator.config` (docs/plugins.md).

A name is looked up, in this order, in the kind's built-in table, among the installed packages'
entry points of the kind's group (`orch.envs`, `orch.trainers`, `orch.inference`,
`orch.algorithms`, `orch.metric_sinks`), and, if it has a colon, as a `module:Attribute` on the
import path. What it finds must be a concrete subclass of the kind's base class; anything else
(no such name, a module that does not import, a missing attribute, an object of another kind) is
a `PluginError`: one line naming what was asked and what was found.
"""

from __future__ import annotations

import importlib
import inspect
import sysconfig
import traceback
from collections.abc import Mapping
from importlib.metadata import entry_points

from orchestrator.contracts import ConfigError

ENTRY_POINT_GROUPS = {
    "env": "orch.envs",
    "trainer": "orch.trainers",
    "inference backend": "orch.inference",
    "algorithm": "orch.algorithms",
    "metric sink": "orch.metric_sinks",
}


class PluginError(ConfigError):
    """A component that does not load or does not meet its kind's contract (one line)."""


def installed_names(kind: str) -> list[str]:
    """The names the installed packages register in `kind`'s entry-point group."""
    return sorted({point.name for point in entry_points(group=ENTRY_POINT_GROUPS[kind])})


def import_attribute(spec: str, what: str) -> object:
    """The object `module:Attribute` names (dots in the attribute walk into it); PluginError
    (one line, starting with `what`) if the module does not import or lacks the attribute."""
    module_name, colon, attribute = spec.partition(":")
    if not colon or not module_name or not attribute:
        raise PluginError(f"{what}: expected 'module:Attribute', got {spec!r}")
    try:
        obj: object = importlib.import_module(module_name)
    except Exception as err:  # noqa: BLE001 - any error of the user's module is reported alike
        raise PluginError(f"{what}: module {module_name!r} does not import ({_cause(err)})") from None
    for part in attribute.split("."):
        if not hasattr(obj, part):
            raise PluginError(f"{what}: module {module_name!r} has no attribute {attribute!r}")
        obj = getattr(obj, part)
    return obj


def resolve(kind: str, name: str, builtins: Mapping[str, str], base: type) -> type:
    """The config model of component `name` of `kind`, a concrete subclass of `base`."""
    spec, what = builtins.get(name), f"{kind} {name!r}"
    if spec is None:
        point = next(iter(entry_points(group=ENTRY_POINT_GROUPS[kind], name=name)), None)
        if point is not None:
            spec, what = point.value, f"{kind} {name!r} (entry point {point.value!r} of {point.group})"
        elif ":" in name:
            spec = name
        else:
            known = ", ".join(sorted({*builtins, *installed_names(kind)}))
            raise PluginError(f"unknown {kind} {name!r}; known: {known} (or a 'module:Attribute' of your own)")
    found = import_attribute(spec, what)
    if not (isinstance(found, type) and issubclass(found, base)):
        wanted = "a class" if base is object else f"a subclass of {base.__module__}.{base.__qualname__}"
        raise PluginError(f"{what} is {_describe(found)}, not {wanted}")
    if inspect.isabstract(found):
        missing = ", ".join(sorted(getattr(found, "__abstractmethods__", ())))
        raise PluginError(f"{what}: {found.__qualname__} does not define {missing}, which every {kind} defines")
    return found


def _describe(obj: object) -> str:
    if isinstance(obj, type):
        return f"the class {obj.__module__}.{obj.__qualname__}"
    return f"a {type(obj).__name__} ({obj!r:.60})"


def _cause(err: BaseException) -> str:
    """The error and where in the user's code it was raised, on one line."""
    frames = [frame for frame in traceback.extract_tb(err.__traceback__) if _is_users(frame.filename)]
    located = frames and not isinstance(err, ImportError | SyntaxError)  # those name their own place
    where = f" at {frames[-1].filename}:{frames[-1].lineno}" if located else ""
    message = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"{type(err).__name__}: {message}{where}" if message else f"{type(err).__name__}{where}"


# Where installed libraries and the standard library live: a frame there is not the user's line
# (a pydantic class error is raised inside pydantic, caused by the user's class).
_LIBRARY_DIRS = tuple(
    {path for key in ("stdlib", "platstdlib", "purelib", "platlib") if (path := sysconfig.get_path(key))}
)


def _is_users(filename: str) -> bool:
    return not filename.startswith("<") and not filename.startswith(_LIBRARY_DIRS)


SINK_METHODS = ("write", "flush", "close")


def resolve_sink(name: str) -> type:
    """A metric sink's class (docs/plugins.md): built as `cls(settings, run_dir, identity)`, it
    has a `target` and the methods of `orchestrator.observe.sinks.Sink`."""
    found = resolve("metric sink", name, {}, object)
    missing = [method for method in SINK_METHODS if not callable(getattr(found, method, None))]
    if missing:
        raise PluginError(
            f"metric sink {name!r}: {found.__qualname__} has no {', '.join(missing)} "
            "(a sink has write(rows, wall_time), flush() and close())"
        )
    return found
