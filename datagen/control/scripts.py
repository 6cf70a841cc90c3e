"""The Lua scripts of the control plane (``datagen/control/lua/*.lua``) and of the workers
(``workers/claim/lua/*.lua``): read from the package, so a wheel works as a checkout does, and called with
named arguments.

A script file opens with its signature, a comment naming each ``KEYS[i]`` and ``ARGV[i]``: the one
place its arguments are spelled. The loader (`source`) binds each to a local of that name before the
script (``local job_key = KEYS[1]``; ``tonumber`` for one marked ``name: number``; a variable tail
``ARGV[n..]`` as a list of the rest), so the script uses only the names (luacheck reads the same
signature, ``.luacheckrc``). A script whose first line is ``--! uses lib`` runs with ``lib.lua`` put
before it: the rules that several scripts share (counting a prompt that ended, rejoining a dispatch
set, counting prompts cancelled before they ran) are written once there, as local functions (Redis
lets a script define no globals).

On the Python side a script's arguments are one frozen dataclass, a `ScriptArgs`, whose fields carry
the signature's names in its order: fields marked `KEY` are its KEYS, the others its ARGV, and a
tuple spreads (a variable tail, or a group of values per item). `LuaScript` holds the dataclass to
the signature when it registers the script, so a field that drifts from the file fails at start-up
(and in ``tests/datagen/test_lua_files.py``). A `LuaScript` is registered when its owner is built
(redis-py only hashes the text then; the first call loads it), so the threads that share an owner
never race to set it up.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from dataclasses import dataclass, fields
from importlib import resources
from types import MappingProxyType
from typing import Any, ClassVar, Generic, TypeVar, cast

from redis import Redis
from redis.client import Pipeline

__all__ = ["CONTROL", "KEY", "Argument", "LuaScript", "ScriptArgs", "signature", "source"]

# The package whose ``lua/`` folder holds the control plane's scripts and the library.
CONTROL = "datagen.control"
LUA_FOLDER = "lua"
LIB = "lib"
# A script's first line, when it calls the library's functions.
USES_LIB = "--! uses lib"
# Marks a `ScriptArgs` field as one of the script's KEYS: ``job: str = field(metadata=KEY)``.
KEY = MappingProxyType({"lua": "KEYS"})
_ROLE = "lua"

Value = str | int | float | bytes

# One line of a signature: ``-- ARGV[3]   name: number   what it is``.
_SIGNATURE_LINE = re.compile(r"^--\s+(KEYS|ARGV)\[(\d+)(\.\.)?\]\s+(\w+)(:\s*number)?\s+\S")


@dataclass(frozen=True)
class Argument:
    """One argument a script's signature names: ``KEYS[index]`` or ``ARGV[index]`` (``tail``: that
    one and every one after it, as a list), bound to the local ``name``, a number if ``number``."""

    kind: str
    index: int
    name: str
    number: bool = False
    tail: bool = False

    def binding(self) -> str:
        """The Lua that binds it."""
        if self.tail:
            return (
                f"local {self.name} = {{}}\n"
                f"for i = {self.index}, #{self.kind} do {self.name}[#{self.name} + 1] = {self.kind}[i] end"
            )
        value = f"{self.kind}[{self.index}]"
        return f"local {self.name} = {f'tonumber({value})' if self.number else value}"


def signature(text: str) -> list[Argument]:
    """The arguments named by the comment a script's text opens with, in order."""
    found = []
    for line in text.splitlines():
        if not line.startswith("--"):
            break
        if m := _SIGNATURE_LINE.match(line):
            found.append(Argument(m[1], int(m[2]), m[4], number=bool(m[5]), tail=bool(m[3])))
    return found


def source(name: str, package: str = CONTROL) -> str:
    """The text Redis runs for ``<package>/lua/<name>.lua``: the library first if the script uses
    it, then the bindings of the script's signature, then the script."""
    text = _read(package, name)
    bindings = "".join(f"{argument.binding()}\n" for argument in signature(text))
    library = _read(CONTROL, LIB) if text.startswith(USES_LIB + "\n") else ""
    return library + bindings + text


# Cached, so that a process reads each file once. Two threads that miss at once both read it and
# keep the same text, which is harmless.
@functools.cache
def _read(package: str, name: str) -> str:
    return (resources.files(package) / LUA_FOLDER / f"{name}.lua").read_text(encoding="utf-8")


@dataclass(frozen=True)
class ScriptArgs:
    """The arguments of one call of script ``script`` (a file name without ``.lua``) of ``package``."""

    script: ClassVar[str]
    package: ClassVar[str] = CONTROL

    @classmethod
    def key_names(cls) -> list[str]:
        return list(_names(cls)[0])

    @classmethod
    def arg_names(cls) -> list[str]:
        return list(_names(cls)[1])

    def keys(self) -> list[str]:
        # Key fields hold strings (or tuples of them).
        return cast(list[str], _flat(getattr(self, name) for name in _names(type(self))[0]))

    def args(self) -> list[Value]:
        return _flat(getattr(self, name) for name in _names(type(self))[1])


# Per class, once: a claim or an ack builds its arguments on every call. Two threads that miss at
# once both compute the same names, which is harmless.
_NAMES: dict[type, tuple[tuple[str, ...], tuple[str, ...]]] = {}


def _names(cls: type) -> tuple[tuple[str, ...], tuple[str, ...]]:
    found = _NAMES.get(cls)
    if found is None:
        role = [(f.name, f.metadata.get(_ROLE) == KEY[_ROLE]) for f in fields(cls)]
        keys = tuple(name for name, is_key in role if is_key)
        found = _NAMES[cls] = (keys, tuple(name for name, is_key in role if not is_key))
    return found


def _flat(values: Iterable[Any]) -> list[Value]:
    out: list[Value] = []
    for value in values:
        if isinstance(value, tuple | list):
            out += _flat(value)
        else:
            out.append(value)
    return out


A = TypeVar("A", bound=ScriptArgs)


class LuaScript(Generic[A]):
    """The script that ``args_type`` names, registered with ``redis``; called with its arguments."""

    def __init__(self, redis: Redis, args_type: type[A]) -> None:
        _check(args_type)
        self._source = source(args_type.script, args_type.package)
        self._script = redis.register_script(self._source)

    def __call__(self, args: A, *, client: Redis | Pipeline | None = None) -> Any:
        keys = args.keys()
        if isinstance(client, Pipeline):
            # In a pipeline redis-py would send SCRIPT EXISTS before every execute (an EVALSHA of
            # a script Redis lacks fails alone inside MULTI, the rest applied): EVAL sends the
            # text instead, one command that cannot miss (Redis caches it by its digest too).
            return client.eval(self._source, len(keys), *keys, *args.args())
        return self._script(keys=keys, args=args.args(), client=client)


def _check(args_type: type[ScriptArgs]) -> None:
    """``args_type`` names the script's signature, KEYS and ARGV, in order (TypeError otherwise)."""
    arguments = signature(_read(args_type.package, args_type.script))
    wanted = tuple(tuple(a.name for a in arguments if a.kind == kind) for kind in ("KEYS", "ARGV"))
    if (tuple(args_type.key_names()), tuple(args_type.arg_names())) != wanted:
        raise TypeError(
            f"{args_type.__name__} names {args_type.key_names()} and {args_type.arg_names()}, but "
            f"{args_type.script}.lua's signature names {list(wanted[0])} and {list(wanted[1])}"
        )
