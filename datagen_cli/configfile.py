"""``--config FILE`` of ``coordinator``, ``worker`` and ``sim``: a YAML mapping of settings and flags.

A key is a setting's name: a ``DATAGEN_*`` variable's name with or without the prefix, in any of the
spellings ``redis_url``, ``redis-url`` or ``DATAGEN_REDIS_URL``; or one of the command's flags that is
no setting (``worker``: ``server``, ``burst``; ``sim``, which reads no environment: all of its
flags). Precedence: a flag on the command line, then the environment, then the file, then the
default. An unknown key, or one given twice, is refused in one line naming it and the file, with the
exit code of the CLI's other usage errors.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
import yaml
from pydantic_settings import BaseSettings

from datagen.settings import ENV_PREFIX, FileValues

__all__ = ["ConfigFile", "ConfigOption", "read_config"]

CONFIG_OPTION = "--config"
COMMAND_LINE = "COMMANDLINE"  # click's ParameterSource of a flag given on the command line
# Flags whose file key names a setting of another name, e.g. `server:` is `DATAGEN_SERVERS`.
FLAG_SETTINGS = {"server": "servers"}
# Settings whose value may be a YAML list, written comma-separated as the environment takes it.
LIST_SETTINGS = frozenset({"servers"})

ConfigOption = Annotated[
    Path | None,
    typer.Option(
        CONFIG_OPTION,
        exists=True,
        dir_okay=False,
        help="YAML file of settings, `key: value` a line, each key a DATAGEN_* variable with or "
        "without the prefix (DATAGEN_REDIS_URL, redis_url) or a flag (redis_url, redis-url); "
        "precedence: flag, environment, this file, default",
    ),
]


@dataclass(frozen=True)
class ConfigFile:
    """One command's config file, split: settings (below the environment) and flags (below the
    command line)."""

    path: str = ""
    settings: FileValues | None = None
    flags: Mapping[str, Any] = field(default_factory=dict)

    def flag(self, ctx: typer.Context, name: str) -> Any:
        """Flag ``name``'s value: the command line's, else the file's, else the flag's default."""
        return self.flags[name] if name in self.used_flags(ctx) else ctx.params[name]

    def used_flags(self, ctx: typer.Context) -> set[str]:
        """The flags whose value comes from the file: in it, and not on the command line."""
        return {name for name in self.flags if not _on_command_line(ctx, name)}


def _on_command_line(ctx: typer.Context, name: str) -> bool:
    source = ctx.get_parameter_source(name)
    return source is not None and source.name == COMMAND_LINE


def read_config(ctx: typer.Context, path: Path | None, model: type[BaseSettings] | None = None) -> ConfigFile:
    """The file's keys sorted into ``model``'s settings and the command's other flags (none: no file)."""
    if path is None:
        return ConfigFile()
    settings: dict[str, str] = {}
    flags: dict[str, Any] = {}
    seen: dict[str, str] = {}
    params = {p.name: p for p in ctx.command.params if p.name and p.name != "config"}
    for key, value in _mapping(ctx, path).items():
        name = _name(key)
        if model is not None:
            name = FLAG_SETTINGS.get(name, name)
        if name in seen:
            _refuse(ctx, f"{key!r} in {path} sets what {seen[name]!r} already sets; keep one")
        seen[name] = key
        if value is None:
            continue  # `key:` with no value: as if not in the file
        if model is not None and name in model.model_fields:
            settings[name] = _setting_text(ctx, path, key, name, value)
        elif name in params:
            flags[name] = _flag_value(ctx, path, key, params[name], value)
        else:
            known = sorted([*(model.model_fields if model else ()), *params])
            close = difflib.get_close_matches(name, known, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            _refuse(ctx, f"unknown key {key!r} in {path}: not a setting or flag of {ctx.command_path}{hint}")
    return ConfigFile(str(path), FileValues(str(path), settings) if model is not None else None, flags)


def _mapping(ctx: typer.Context, path: Path) -> dict[Any, Any]:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError, RecursionError, ValueError) as exc:
        _refuse(ctx, f"cannot read {path}: {' '.join(str(exc).split())}")
    if data is None:
        return {}
    if not isinstance(data, dict):
        _refuse(ctx, f"{path} must be a mapping of `key: value` lines, not a {type(data).__name__}")
    for key in data:
        if not isinstance(key, str):
            _refuse(ctx, f"key {key!r} in {path} is not a name; write a setting's name, such as redis_url")
    return data


def _name(key: str) -> str:
    """``DATAGEN_REDIS_URL``, ``redis-url`` and ``redis_url`` are all ``redis_url``."""
    if key.startswith(ENV_PREFIX):
        key = key.removeprefix(ENV_PREFIX).lower()
    return key.replace("-", "_")


def _setting_text(ctx: typer.Context, path: Path, key: str, name: str, value: object) -> str:
    """The value as the environment would spell it, so that it is read as a variable's would be."""
    if isinstance(value, list) and name in LIST_SETTINGS:
        return ",".join(_setting_text(ctx, path, key, name, item) for item in value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (str, int, float)):
        return str(value)
    _refuse(
        ctx,
        f"{key!r} in {path} must be one value (a string, number or true/false), not a {type(value).__name__}",
    )


def _flag_value(ctx: typer.Context, path: Path, key: str, param: Any, value: object) -> Any:
    """The value converted and checked as the flag's own would be (a number in its range, a list for a
    repeatable flag)."""
    if isinstance(value, (list, dict)) and not param.multiple:
        _refuse(ctx, f"{key!r} in {path} takes one value, not a {type(value).__name__}")
    try:
        return param.process_value(ctx, value if isinstance(value, list) or not param.multiple else [value])
    except typer.BadParameter as exc:
        _refuse(ctx, f"{key!r} in {path}: {exc.message}")


def _refuse(ctx: typer.Context, message: str) -> NoReturn:
    raise typer.BadParameter(message, ctx=ctx, param_hint=f"'{CONFIG_OPTION}'")
