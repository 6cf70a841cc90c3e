"""The one Typer app every command registers on, the shared console, exit codes and ``main()``.

``main()`` is the one place where a command's failure becomes what the user reads: every failure a
user can meet (our own errors, a bad flag value, Redis or the coordinator out of reach, a port in
use, a file that cannot be read or written, Ctrl-C) is one line on stderr that says what to do,
and an exit code. The traceback is shown only with ``--debug`` or ``DATAGEN_LOG_LEVEL=DEBUG``; an
error of none of these kinds is a bug, and says so.
"""

from __future__ import annotations

import errno
import os
import sys
from importlib import metadata
from typing import Annotated

import typer
from rich.console import Console
from rich.text import Text

from datagen.errors import DatagenError

# Plain click help (rich_markup_mode=None), not Rich's panels: Rich's option table cuts long option
# names at 80 columns (`--short-max-new-tok…`) and gives every flag a `<bool>` type; click's list keeps
# each name whole on its own line, shows no type for a flag, and wraps only the help text.
app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    help=(
        "Exact-token EAGLE-3 training data from SGLang or vLLM servers.\n\n"
        "A job's tokenizer (such as /models/DeepSeek-R1 below) must be under a path or hub id listed in "
        "the coordinator's DATAGEN_TOKENIZER_ALLOWLIST; the bundled DeepSeek tokenizer always is."
    ),
)
console = Console(stderr=True)

# `submit --wait` exits with datagen_cli.waiting's codes (0 all done, 1 some prompts failed, 2 job failed).
EXIT_ERROR = 3
EXIT_CHECK_FAILED = 1  # `datagen report`: a token-structure check failed
EXIT_USAGE = 2  # a flag or argument click refused
EXIT_INTERRUPTED = 130  # Ctrl-C, as shells report SIGINT
LOG_LEVEL_VARIABLE = "DATAGEN_LOG_LEVEL"
DEBUG_LEVEL = "DEBUG"
# Third-party notices that read like errors to a user of a tool that never needs them:
# transformers' "PyTorch was not found" (we only use tokenizers). Set for child processes too.
QUIET_ENVIRONMENT = {"TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}
DISTRIBUTION = "eagle3-datagen"  # `datagen --version` prints its installed version


def examples(*commands: str) -> str:
    """A command's help epilog: working invocations, one a line, shown as written (click's ``\\b``
    keeps a paragraph from being rewrapped)."""
    return "Examples:\n\n\b\n" + "\n".join(f"  {command}" for command in commands)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"datagen {metadata.version(DISTRIBUTION)}")
        raise typer.Exit()


@app.callback(
    epilog=examples(
        "datagen demo",
        "datagen submit prompts.jsonl --tokenizer /models/DeepSeek-R1 --wait",
        "datagen status",
        "datagen submit --help",
    )
)
def _options(
    debug: Annotated[
        bool,
        typer.Option("--debug", help="debug logs, and a traceback with any error (DATAGEN_LOG_LEVEL=DEBUG)"),
    ] = False,
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            is_eager=True,
            callback=_print_version,
            help=f"print {DISTRIBUTION}'s version and exit",
        ),
    ] = False,
) -> None:
    if debug:
        # Read by every process's settings (log level) and by main() (tracebacks); inherited by the
        # processes `datagen demo` starts.
        os.environ[LOG_LEVEL_VARIABLE] = DEBUG_LEVEL


def _debugging() -> bool:
    return os.environ.get(LOG_LEVEL_VARIABLE, "").strip().upper() == DEBUG_LEVEL


def fail(message: str) -> None:
    """Print ``error: message`` as one line on stderr (never wrapped, never read as markup)."""
    console.print(Text.assemble(("error:", "red"), " ", message), soft_wrap=True, highlight=False)


def main() -> None:
    for name, value in QUIET_ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    try:
        # One name in usage lines and hints, whether started as `datagen` or `python -m datagen_cli`.
        code = app(standalone_mode=False, prog_name="datagen")
    except (KeyboardInterrupt, typer.Abort):
        sys.exit(EXIT_INTERRUPTED)
    except Exception as exc:
        usage = _usage_error(exc)
        if usage is not None:
            if usage:
                fail(usage)
            sys.exit(getattr(exc, "exit_code", EXIT_USAGE))
        if _debugging():
            raise
        fail(describe_failure(exc))
        sys.exit(EXIT_ERROR)
    sys.exit(code if isinstance(code, int) else 0)


def _usage_error(exc: Exception) -> str | None:
    """The message of click's refusal of the command line ("" when it was the help, printed here);
    None for any other error. Typer vendors click in recent versions, so the classes are known by
    shape."""
    if type(exc).__name__ == "NoArgsIsHelpError":
        typer.echo(str(exc))  # `datagen` alone: the refusal's message is the help
        return ""
    format_message = getattr(exc, "format_message", None)
    if not callable(format_message) or not isinstance(getattr(exc, "exit_code", None), int):
        return None
    ctx = getattr(exc, "ctx", None)
    hint = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
    return f"{format_message()}{hint}"


def describe_failure(exc: BaseException) -> str:
    """One line for a failure a user can meet; a bug says that it is one."""
    import httpx
    import redis

    if isinstance(exc, DatagenError):
        return str(exc)
    if isinstance(exc, (redis.ConnectionError, redis.TimeoutError)):
        return f"cannot reach Redis ({exc}); check that it runs and DATAGEN_REDIS_URL (--redis-url)"
    if isinstance(exc, redis.RedisError):
        return f"Redis refused a command ({exc}); check DATAGEN_REDIS_URL and the Redis server's log"
    if isinstance(exc, httpx.TransportError):
        return (
            f"cannot reach a server over HTTP ({type(exc).__name__}: {exc}); check its URL and that it runs"
        )
    if isinstance(exc, OSError):
        return _os_error(exc)
    return (
        f"unexpected {type(exc).__name__}: {exc}. This is a bug: rerun with --debug "
        "(or DATAGEN_LOG_LEVEL=DEBUG) for the traceback, and report it"
    )


def _os_error(exc: OSError) -> str:
    where = f" {exc.filename}" if exc.filename else ""
    if exc.errno == errno.EADDRINUSE:
        return f"address in use ({exc.strerror}): another process listens on that port; choose another"
    if isinstance(exc, PermissionError):
        return f"permission denied:{where}; give this user access, or choose another path"
    if isinstance(exc, FileNotFoundError):
        return f"no such file or directory:{where}; check the path"
    return f"{exc.strerror or exc}:{where}" if where else f"{exc.strerror or exc}"
