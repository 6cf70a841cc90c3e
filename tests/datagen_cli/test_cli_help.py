"""`datagen … --help` explains itself in an 80-column terminal (issue 27, parts 3 and 4).

Every command's help, rendered as a user reads it: every option and argument has help text, option
names are never cut, a flag shows no value type (`<bool>`), no line is wider than the terminal, and
the examples in each epilog use only commands and flags that exist. `datagen --version` prints the
installed version. Every `--flag` that README.md and docs/ name exists on some datagen command (the
docs are read when the test runs, so a rewrite is checked as it is).
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from datagen.spec import SamplingParams
from datagen_cli import app

ROOT = Path(__file__).resolve().parents[2]
WIDTH = 80
PROG = "datagen"
# Flags of other tools that the docs show next to datagen's; each says whose it is.
FOREIGN_FLAGS = {
    "--check": "ruff format --check, in the CI command",
    "--strict": "mkdocs build --strict, in the CI command",
    "--dev-addr": "mkdocs serve --dev-addr",
    "--dist": "pytest -n 4 --dist loadgroup, in scripts/check and docs/development.md",
    "--data": "SpecForge's prepare_data.py --data",
    "--profile": "docker compose --profile",
    "--build": "docker compose up --build",
    "--no-deps": "docker compose up --no-deps",
    "--enable-metrics": "SGLang's server flag (python -m sglang.launch_server)",
    # vLLM's server flags (`vllm serve`), in docs/reference/vllm-contract.md
    "--generation-config": "vllm serve --generation-config",
    "--override-generation-config": "vllm serve --override-generation-config",
    "--enable-prompt-tokens-details": "vllm serve --enable-prompt-tokens-details",
    "--shutdown-timeout": "vllm serve --shutdown-timeout",
    "--scheduling-policy": "vllm serve --scheduling-policy",
    "--enable-server-load-tracking": "vllm serve --enable-server-load-tracking",
    "--max-model-len": "vllm serve --max-model-len, in docs/operator/running-a-fleet.md",
    "--speculative-config": "vllm serve --speculative-config (capture servers, docs/user/features.md)",
    "--kv-transfer-config": "vllm serve --kv-transfer-config (capture servers, docs/user/features.md)",
    "--data-path": "speculators' train.py --data-path, in docs/user/features.md",
    "--reasoning-effort-cycle": "speculators' data generation flag (#1037), in docs/user/recipes.md",
    "--temperature-cycle": "speculators' data generation flag (#1037), in docs/user/recipes.md",
    "--max-num-seqs": "vllm serve --max-num-seqs",
    "--gpu-memory-utilization": "vllm serve --gpu-memory-utilization",
    "--served-model-name": "vllm serve --served-model-name",
    "--enable-prefix-caching": "vllm serve --enable-prefix-caching",
    "--disable-log-stats": "vllm serve --disable-log-stats",
    "--max-running-requests": "SGLang's server flag (python -m sglang.launch_server)",
    "--by-reference": "bench/ingest_load.py --by-reference, in docs/status.md",
    "--until-first-prompt": "bench/ingest_load.py --until-first-prompt, in docs/status.md and datasets.md",
    "--requirepass": "redis-server --requirepass",
    "--appendonly": "redis-server --appendonly, in compose.yaml",
    "--appendfsync": "redis-server --appendfsync, in compose.yaml",
    "--save": "redis-server --save '', in the README's tour",
    "--loglevel": "redis-server --loglevel, in the README's tour",
    "--dir": "redis-server --dir, in docs/operator/running-a-fleet.md",
    "--local-dir": "huggingface-cli download --local-dir, in docs/operator/real-model.md",
    "--model-path": "SGLang's server flag (sglang.launch_server), in docs/operator/real-model.md",
    "--context-length": "SGLang's server flag (sglang.launch_server), in docs/operator/real-model.md",
    "--disable-radix-cache": "SGLang's server flag (sglang.launch_server), in docs/operator/real-model.md",
}
FLAG = re.compile(r"(?<![\w-])--[a-z0-9][a-z0-9-]*")
FENCE = re.compile(r"^[ \t]*```[^\n]*\n(.*?)^[ \t]*```", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"(`+)(.+?)\1", re.DOTALL)


def _commands(command: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    yield path, command
    # By shape: recent Typer vendors click, so its classes are not click's.
    for name, sub in getattr(command, "commands", {}).items():
        yield from _commands(sub, (*path, name))


COMMANDS = dict(_commands(typer.main.get_command(app)))


def _help(path: tuple[str, ...]) -> str:
    result = CliRunner(env={"COLUMNS": str(WIDTH)}).invoke(
        app, [*path, "--help"], prog_name=PROG, terminal_width=WIDTH
    )
    assert result.exit_code == 0, result.output
    return result.output


def _names(command: Any) -> set[str]:
    """The command's option and argument names, and the ``--help`` click gives every command."""
    return {"--help"} | {name for param in command.params for name in (*param.opts, *param.secondary_opts)}


@pytest.mark.parametrize("path", list(COMMANDS), ids=lambda path: " ".join((PROG, *path)))
def test_help_at_80_columns_names_every_option_whole(path: tuple[str, ...]) -> None:
    command = COMMANDS[path]
    text = _help(path)
    for param in command.params:
        assert (getattr(param, "help", None) or "").strip(), f"{param.name} of {' '.join(path)} has no help"
        if param.param_type_name == "option":
            for name in (*param.opts, *param.secondary_opts):
                assert re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text), f"{name} cut:\n{text}"
    assert "…" not in text and "<bool>" not in text, text
    for line in text.splitlines():
        assert len(line) <= WIDTH, f"wider than {WIDTH} columns: {line!r}"
        # A mention of an option broken at one of its hyphens.
        assert not re.search(r"(?<![\w-])--[\w-]*-$", line), f"option split over two lines: {line!r}"


@pytest.mark.parametrize("path", list(COMMANDS), ids=lambda path: " ".join((PROG, *path)))
def test_every_example_uses_real_commands_and_flags(path: tuple[str, ...]) -> None:
    epilog = COMMANDS[path].epilog or ""
    lines = [line.strip() for line in epilog.splitlines()[1:] if line.strip() and line.strip() != "\b"]
    assert epilog.startswith("Examples:") and lines, f"{' '.join(path)} has no examples"
    for line in lines:
        words = shlex.split(line)
        while words and "=" in words[0] and not words[0].startswith("-"):
            words.pop(0)  # VAR=value before the command
        assert words[0] == PROG, line
        command_name, *args = words[1:]
        command = COMMANDS[(command_name,)]
        for arg in args:
            if arg.startswith("--"):
                assert arg.split("=", 1)[0] in _names(command), f"{arg} in {line!r}"


def test_submit_help_states_the_sampling_defaults() -> None:
    command = COMMANDS[("submit",)]
    helps = {param.name: getattr(param, "help", "") for param in command.params}
    assert f"default {SamplingParams().temperature:g}" in helps["temperature"]
    assert f"default {SamplingParams().top_p:g}" in helps["top_p"]


def test_version_prints_the_installed_version() -> None:
    result = CliRunner().invoke(app, ["--version"], prog_name=PROG)
    assert result.exit_code == 0, result.output
    assert result.output == f"datagen {metadata.version('eagle3-datagen')}\n"


def test_datagen_alone_prints_the_help() -> None:
    """Through ``main()``, which turns click's refusals into one line: no command is the help."""
    result = subprocess.run(
        [sys.executable, "-m", "datagen_cli"], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 2, result.stderr
    assert result.stdout.startswith("Usage: ") and "datagen [OPTIONS] COMMAND" in result.stdout
    assert "error:" not in result.stderr


def _doc_flags(path: Path) -> Iterator[tuple[int, str]]:
    """(line, flag) for each `--flag` in the file's code: fenced blocks and inline code spans."""
    text = path.read_text(encoding="utf-8")
    spans: list[tuple[int, str]] = []
    for fence in FENCE.finditer(text):
        spans.append((fence.start(1), fence.group(1)))
    prose = FENCE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)  # blanked, offsets kept
    for code in INLINE_CODE.finditer(prose):
        spans.append((code.start(2), code.group(2)))
    for start, span in spans:
        for flag in FLAG.finditer(span):
            yield text.count("\n", 0, start + flag.start()) + 1, flag.group(0)


def test_every_flag_the_docs_name_exists() -> None:
    known = set().union(*(_names(command) for command in COMMANDS.values()))
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    missing = [
        f"{path.relative_to(ROOT)}:{line}: {flag}"
        for path in docs
        for line, flag in _doc_flags(path)
        if flag not in known and flag not in FOREIGN_FLAGS
    ]
    assert not missing, "flags no datagen command has:\n" + "\n".join(missing)


# Every command that talks to a coordinator (issue 39): all take --coordinator, defined once.
COORDINATOR_COMMANDS = ("submit", "status", "wait", "pause", "resume", "cancel", "retry", "recover", "delete")


@pytest.mark.parametrize("name", COORDINATOR_COMMANDS)
def test_every_command_that_talks_to_a_coordinator_takes_coordinator(name: str) -> None:
    text = " ".join(_help((name,)).split())
    assert (
        "--coordinator <str> coordinator URL (DATAGEN_COORDINATOR_URL, default http://127.0.0.1:8000)" in text
    )


def test_the_coordinator_option_is_one_definition() -> None:
    [option] = {
        param.help
        for path, command in COMMANDS.items()
        for param in command.params
        if param.name == "coordinator"
    }
    assert option == "coordinator URL (DATAGEN_COORDINATOR_URL, default http://127.0.0.1:8000)"
