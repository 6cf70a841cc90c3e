"""The Redis scripts as files (`datagen.control.scripts`): each opens with a signature that names its KEYS
and ARGV, the one place they are spelled: the loader binds them to those names, the script uses only
the names, and the Python argument objects name the same arguments in the same order (checked when
a script is registered); the library's functions are declared where they are used; what the scripts
write of RQ's format and of a job's breakdown is what `datagen.control.rq_format` and
`datagen.control.keys.BreakdownField` say; and no Python module carries Lua of its own."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis

import datagen.control.dispatch
import datagen.control.epoch
import datagen.control.ingest_chunks
import datagen.control.job_outcomes
import datagen.control.jobs
import datagen.control.leases
import workers.claim.reaper
import workers.claim.rqbridge
from datagen.control.dispatch import ClaimManyArgs, Dispatch
from datagen.control.jobs import JobStore
from datagen.control.keys import FINISH_PREFIX, OTHER_LABEL, UNKNOWN_LABEL, BreakdownField, Keys
from datagen.control.rq_format import SCRIPT_WRITES
from datagen.control.scripts import (
    CONTROL,
    KEY,
    LIB,
    USES_LIB,
    Argument,
    LuaScript,
    ScriptArgs,
    signature,
    source,
)
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
    datagen.control.ingest_chunks,
    datagen.control.leases,
    workers.claim.reaper,
    workers.claim.rqbridge,
)

ARGUMENTS = re.compile(r"\b(KEYS|ARGV)\b")


def _code(lines: list[str]) -> str:
    return "\n".join(line.split("--", 1)[0] for line in lines)


def _body(path: Path) -> str:
    """A script's code past its opening comment."""
    lines = path.read_text(encoding="utf-8").splitlines()
    opening = next(i for i, line in enumerate(lines) if not line.startswith("--"))
    return _code(lines[opening:])


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
def test_a_script_names_its_arguments_once_and_uses_only_those_names(package: str, path: Path) -> None:
    arguments = signature(path.read_text(encoding="utf-8"))
    assert arguments, f"{path.name}: a signature"
    names = [a.name for a in arguments]
    assert len(set(names)) == len(names), f"{path.name}: each name once"
    for kind in ("KEYS", "ARGV"):
        entries = [a for a in arguments if a.kind == kind]
        # Numbered from 1 in order; a variable tail (``ARGV[n..]``) only last.
        assert [a.index for a in entries] == list(range(1, len(entries) + 1)), (path.name, kind)
        assert not any(a.tail for a in entries[:-1]), (path.name, kind)
    body = _body(path)
    assert not ARGUMENTS.search(body), f"{path.name}: KEYS or ARGV read past the signature's bindings"
    # luacheck takes the names as globals, so it cannot see one the script never reads.
    unused = [name for name in names if not re.search(rf"\b{name}\b", body)]
    assert not unused, f"{path.name}: named in its signature but never used: {unused}"


@pytest.mark.parametrize(("package", "path"), SCRIPTS, ids=lambda p: getattr(p, "stem", p))
def test_a_script_that_calls_the_library_says_so(package: str, path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    calls = {name for name in _lib_functions() if re.search(rf"\b{name}\(", _code(text.splitlines()))}
    assert text.startswith(USES_LIB + "\n") == bool(calls), f"{path.name}: {USES_LIB} when it calls {calls}"
    loaded = source(path.stem, package)
    bindings = "".join(f"{a.binding()}\n" for a in signature(text))
    library = LIB_FILE.read_text(encoding="utf-8") if calls else ""
    assert loaded == library + bindings + text


def test_the_loader_binds_each_argument_to_its_name(redis_client: redis.Redis) -> None:
    header = (
        "-- KEYS[1]   hash           a hash\n"
        "-- ARGV[1]   label          a text\n"
        "-- ARGV[2]   count: number  a number\n"
        "-- ARGV[3..] rest           the rest\n"
    )
    arguments = signature(header + "return 1\n")
    assert arguments == [
        Argument("KEYS", 1, "hash"),
        Argument("ARGV", 1, "label"),
        Argument("ARGV", 2, "count", number=True),
        Argument("ARGV", 3, "rest", tail=True),
    ]
    bindings = "".join(f"{a.binding()}\n" for a in arguments)
    script = bindings + "return {hash, label, count + 1, #rest, rest[2]}\n"
    assert redis_client.eval(script, 1, "h", "x", "41", "a", "b", "c") == [b"h", b"x", 42, 3, b"b"]


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
        arguments = signature((FOLDERS[package] / f"{name}.lua").read_text(encoding="utf-8"))
        names = (args_type.key_names(), args_type.arg_names())
        assert names == tuple([a.name for a in arguments if a.kind == kind] for kind in ("KEYS", "ARGV")), (
            name
        )


@dataclass(frozen=True)
class _DriftedReleaseArgs(ScriptArgs):
    script = "release"
    lock: str = field(metadata=KEY)
    holder: str  # release.lua's signature names it ``token``


def test_an_argument_object_that_drifts_from_its_script_is_refused_at_registration(
    redis_client: redis.Redis,
) -> None:
    with pytest.raises(TypeError, match=r"release\.lua's signature names \['lock'\] and \['token'\]"):
        LuaScript(redis_client, _DriftedReleaseArgs)


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


def test_the_scripts_write_a_jobs_breakdown_as_breakdown_field_encodes_it(redis_client: redis.Redis) -> None:
    # One codec on each side: lib.lua's `breakdown_field`, which every script builds its fields
    # with, and BreakdownField; and the labels the library writes are the keys module's.
    lib = LIB_FILE.read_text(encoding="utf-8")
    calls = "breakdown_field(ARGV[1], ARGV[2], ARGV[3]), partition_label({partitions = KEYS[1]}, ARGV[2], {})"
    field, label = redis_client.eval(
        f"{lib}return {{{calls}}}", 1, "none", f"{FINISH_PREFIX}stop", "math", "short"
    )
    assert field.decode() == BreakdownField(f"{FINISH_PREFIX}stop", "math", "short").encode()
    assert label.decode() == OTHER_LABEL
    assert f"'{FINISH_PREFIX}'" in lib and f"'{UNKNOWN_LABEL}'" in lib
    separators = {
        path.name: n
        for _, path in [*SCRIPTS, (CONTROL, LIB_FILE)]
        if (n := _code(path.read_text(encoding="utf-8").splitlines()).count("'|'"))
    }
    assert separators == {LIB_FILE.name: 2}, "only breakdown_field joins a field's parts"


def test_the_scripts_write_rq_s_format_as_rq_format_names_it() -> None:
    # Every HSET of an RQ job hash (``rqkey``) in the scripts writes the fields (and literal statuses)
    # that `datagen.control.rq_format.SCRIPT_WRITES` lists for it, and no other script writes one.
    written: dict[str, dict[str, str | None]] = {}
    for _, path in [*SCRIPTS, (CONTROL, LIB_FILE)]:
        code = _code(path.read_text(encoding="utf-8").splitlines())
        for call in re.findall(r"redis\.call\('HSET', rqkey, (.*?)\)", code, re.DOTALL):
            values = [v.strip() for v in call.split(",")]
            for name, value in zip(values[::2], values[1::2], strict=True):
                literal = value.strip("'") if value.startswith("'") else None
                written.setdefault(path.stem, {})[name.strip("'")] = literal
    assert written == {script: dict(fields) for script, fields in SCRIPT_WRITES.items()}
