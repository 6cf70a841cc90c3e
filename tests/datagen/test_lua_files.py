"""The Redis scripts as files (`datagen.control.lua`): each opens with a signature that names its KEYS
and ARGV, binds them to those names in its first lines and uses only the names after; the Python
argument objects name the same arguments in the same order; the library's functions are declared
where they are used; and no Python module carries Lua of its own."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import redis

import datagen.control.dispatch
import datagen.control.epoch
import datagen.control.job_outcomes
import datagen.control.jobs
import datagen.control.leases
import workers.claim.reaper
import workers.claim.rqbridge
from datagen.control.dispatch import ClaimManyArgs, Dispatch
from datagen.control.jobs import JobStore
from datagen.control.keys import UNKNOWN_LABEL, BreakdownField, Keys
from datagen.control.lua import CONTROL, LIB, USES_LIB, ScriptArgs, source
from datagen.states import JobState, Priority, PromptClass

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = {CONTROL: ROOT / "datagen" / "control" / "lua", "workers.claim": ROOT / "workers" / "claim" / "lua"}
SCRIPTS = sorted(
    (package, path)
    for package, folder in FOLDERS.items()
    for path in folder.glob("*.lua")
    if path.stem != LIB
)
LIB_FILE = FOLDERS[CONTROL] / f"{LIB}.lua"
# The modules whose `ScriptArgs` are checked against the files.
OWNERS = (
    datagen.control.jobs,
    datagen.control.job_outcomes,
    datagen.control.dispatch,
    datagen.control.epoch,
    datagen.control.leases,
    workers.claim.reaper,
    workers.claim.rqbridge,
)

SIGNATURE = re.compile(r"^--\s+(KEYS|ARGV)\[(\d+)(\.\.)?\]\s+(\w+)\s+\S")
BINDING = re.compile(r"^local (\w+) = .*\b(KEYS|ARGV)\[(\d+)\]")
TAIL_LOOP = re.compile(r"^for i = (\d+), #(KEYS|ARGV)\b")
ARGUMENTS = re.compile(r"\b(KEYS|ARGV)\b")


class Signature:
    """A script file cut into its signature (the opening comment), its bindings (up to the first
    blank line) and its body."""

    def __init__(self, path: Path) -> None:
        lines = path.read_text(encoding="utf-8").splitlines()
        opening = next(i for i, line in enumerate(lines) if not line.startswith("--"))
        blank = lines.index("", opening)
        self.header, self.bindings, self.body = lines[:opening], lines[opening:blank], lines[blank:]
        # KEYS or ARGV -> [(index, name, variable tail)], in the order written.
        self.entries: dict[str, list[tuple[int, str, bool]]] = {"KEYS": [], "ARGV": []}
        for line in self.header:
            if m := SIGNATURE.match(line):
                self.entries[m[1]].append((int(m[2]), m[4], bool(m[3])))

    def names(self, kind: str) -> list[str]:
        return [name for _, name, _ in self.entries[kind]]


def _code(lines: list[str]) -> str:
    return "\n".join(line.split("--", 1)[0] for line in lines)


def _lib_functions() -> list[str]:
    return re.findall(r"^local function (\w+)\(", LIB_FILE.read_text(encoding="utf-8"), re.MULTILINE)


def _args_types() -> dict[tuple[str, str], type[ScriptArgs]]:
    found = {}
    for owner in OWNERS:
        for value in vars(owner).values():
            if (
                isinstance(value, type)
                and issubclass(value, ScriptArgs)
                and value.__module__ == owner.__name__
            ):
                found[(value.package, value.script)] = value
    return found


@pytest.mark.parametrize(("package", "path"), SCRIPTS, ids=lambda p: getattr(p, "stem", p))
def test_a_script_opens_with_its_signature_and_uses_only_the_names_it_binds(package: str, path: Path) -> None:
    script = Signature(path)
    for kind, entries in script.entries.items():
        # Numbered from 1 in order; a variable tail (``ARGV[n..]``) only last.
        assert [index for index, _, _ in entries] == list(range(1, len(entries) + 1)), (kind, entries)
        assert not any(tail for _, _, tail in entries[:-1]), (kind, entries)
        bound = {}
        for line in script.bindings:
            if (m := BINDING.match(line)) and m[2] == kind:
                bound[int(m[3])] = m[1]
        tails = {
            int(m[1]) for line in script.bindings if (m := TAIL_LOOP.match(line.strip())) and m[2] == kind
        }
        fixed = {index: name for index, name, tail in entries if not tail}
        assert bound == fixed, f"{path.name}: each {kind}[i] binds to the name its signature gives it"
        assert tails == {index for index, _, tail in entries if tail}, f"{path.name}: {kind}'s tail"
        used = {int(i) for i in re.findall(rf"\b{kind}\[(\d+)\]", _code(script.bindings))}
        assert used <= set(fixed), f"{path.name}: {kind} used without a signature"
    assert not ARGUMENTS.search(_code(script.body)), f"{path.name}: KEYS or ARGV past its bindings"


@pytest.mark.parametrize(("package", "path"), SCRIPTS, ids=lambda p: getattr(p, "stem", p))
def test_a_script_that_calls_the_library_says_so(package: str, path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    calls = {name for name in _lib_functions() if re.search(rf"\b{name}\(", _code(text.splitlines()))}
    assert text.startswith(USES_LIB + "\n") == bool(calls), f"{path.name}: {USES_LIB} when it calls {calls}"
    loaded = source(path.stem, package)
    assert loaded.endswith(text) and (loaded != text) == bool(calls)


def test_the_library_reads_no_arguments_and_luacheck_knows_its_functions() -> None:
    assert not ARGUMENTS.search(_code(LIB_FILE.read_text(encoding="utf-8").splitlines()))
    luacheckrc = (ROOT / ".luacheckrc").read_text(encoding="utf-8")
    declared = re.search(r"local lib = \{(.*?)\}", luacheckrc, re.DOTALL)
    assert declared is not None
    assert sorted(re.findall(r'"(\w+)"', declared[1])) == sorted(_lib_functions())


def test_each_script_has_one_argument_object_that_names_its_signature() -> None:
    found = _args_types()
    assert sorted(found) == sorted((package, path.stem) for package, path in SCRIPTS)
    for (package, name), args_type in found.items():
        script = Signature(FOLDERS[package] / f"{name}.lua")
        names = (args_type.key_names(), args_type.arg_names())
        assert names == (script.names("KEYS"), script.names("ARGV")), name


def test_no_python_module_carries_lua() -> None:
    for package in ("datagen", "service", "workers"):
        for path in (ROOT / package).rglob("*.py"):
            text = path.read_text(encoding="utf-8")
            assert "redis.call(" not in text and "redis.pcall(" not in text, path


def test_prompts_cancelled_before_they_ran_count_alike_from_python_and_from_a_backlog(
    redis_client: redis.Redis,
) -> None:
    keys = Keys("lua")
    redis_client.hset(keys.job("j"), "state", JobState.CANCELLED.value)
    redis_client.rpush(keys.job_backlog("j", PromptClass.SHORT), "lua-j-a", "lua-j-b")
    assert Dispatch(redis_client, keys).withdraw("j") == 2
    with redis_client.pipeline() as pipe:
        JobStore(redis_client, keys).outcomes.count_cancelled_queued(pipe, "j", PromptClass.SHORT, 3)
        pipe.execute()
    assert redis_client.hget(keys.job("j"), "cancelled") == b"5"
    assert redis_client.hgetall(keys.job_breakdown("j")) == {b"cancelled|unknown|short": b"5"}
    assert JobStore(redis_client, keys).breakdown("j") == {
        BreakdownField("cancelled", UNKNOWN_LABEL, "short"): 5
    }


def test_the_claim_scripts_priority_sets_are_named_by_the_priority_enum() -> None:
    # claim_many.lua finds a job's dispatch set by its stored priority (`sets[priority]`): its keys
    # must be named exactly as Priority's values, and dispatch must fill them in that order of rank.
    keys = ClaimManyArgs.key_names()
    assert [k for k in keys if k in {p.value for p in Priority}] == [
        p.value for p in sorted(Priority, key=lambda p: p.rank)
    ]
    script = (FOLDERS[CONTROL] / "claim_many.lua").read_text()
    assert "local sets = {" + ", ".join(f"{p.value} = {p.value}" for p in Priority) + "}" in script
