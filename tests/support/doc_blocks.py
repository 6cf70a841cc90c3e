"""A page's shell blocks, run in the order written, as one bash script in a fresh directory.

Used by the README's test (``<!-- readme-in-order: run -->``) and the operator guide's fleet start
(``<!-- fleet-start-in-order: run -->``). :func:`marked_blocks` finds the marked ```` ```bash ````
blocks; :func:`with_free_ports` swaps the page's ports for free ones; :func:`wait_for_fleet_line`
is the line a script runs where a reader would watch the terminals until the coordinator answers
and enough servers are up; :func:`run_script` runs the script with the real processes (its ``&``
lines in the background, in one process group that is stopped after, gently first).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from datagen_cli.local.redis_server import find_redis_binary, free_port

__all__ = [
    "FLEET_TIMEOUT_S",
    "REPO",
    "STOP_TIMEOUT_S",
    "ScriptRun",
    "checkout_home",
    "free_ports",
    "group_alive",
    "marked_blocks",
    "run_script",
    "wait_for_fleet_line",
    "with_free_ports",
]

REPO = Path(__file__).resolve().parents[2]
STOP_TIMEOUT_S = 30
FLEET_TIMEOUT_S = 120
# Waits for the coordinator's /servers to list at least argv[2] servers up (argv[1]: seconds).
WAIT_FOR_FLEET = """\
import json, os, sys, time, urllib.request
url = os.environ["DATAGEN_COORDINATOR_URL"].rstrip("/")
deadline = time.monotonic() + float(sys.argv[1])
while time.monotonic() < deadline:
    try:
        with urllib.request.urlopen(url + "/servers", timeout=3) as answer:
            if sum(s["state"] == "up" for s in json.load(answer)["servers"]) >= int(sys.argv[2]):
                sys.exit(0)
    except OSError:
        pass
    time.sleep(0.2)
sys.exit("the coordinator and its servers did not come up")
"""


def marked_blocks(page: Path, mark: str) -> list[str]:
    """The bodies of the ```` ```bash ```` blocks right after ``mark`` on ``page``, in order."""
    block = re.compile(re.escape(mark) + r"\s*\n```bash\n(.*?)\n```", re.DOTALL)
    return block.findall(page.read_text("utf-8"))


def free_ports(page_ports: tuple[int, ...]) -> dict[int, int]:
    return {page_port: free_port() for page_port in page_ports}


def with_free_ports(block: str, ports: dict[int, int]) -> str:
    for page_port, port in ports.items():
        block = re.sub(rf"\b{page_port}\b", str(port), block)
    return block


def wait_for_fleet_line(tmp_path: Path, servers_up: int, timeout_s: float = FLEET_TIMEOUT_S) -> str:
    helper = tmp_path / "wait_for_fleet.py"
    helper.write_text(WAIT_FOR_FLEET)
    return f"python {helper} {timeout_s:g} {servers_up}"


def checkout_home(tmp_path: Path) -> Path:
    """A fresh directory holding only links to the checkout's examples/ and datagen/."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "examples").symlink_to(REPO / "examples")
    (home / "datagen").symlink_to(REPO / "datagen")
    return home


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _stop_group(pgid: int) -> None:
    """End the script's background processes (the page's `&` lines), gently first."""
    if not group_alive(pgid):
        return
    os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if group_alive(pgid):
        os.killpg(pgid, signal.SIGKILL)


@dataclass(frozen=True)
class ScriptRun:
    code: int | None  # None: it ran past its timeout
    output: str  # stdout and stderr together
    pgid: int  # the script's process group, being stopped (see group_alive)
    script: str


def run_script(lines: list[str], home: Path, tmp_path: Path, timeout_s: float) -> ScriptRun:
    """Run ``lines`` under ``set -euo pipefail`` in ``home``, without the caller's ``DATAGEN_*``.

    ``redis-server`` on the PATH is the one the project's tests use, ``python`` this interpreter.
    """
    tools = tmp_path / "bin"
    tools.mkdir(exist_ok=True)
    if not (tools / "redis-server").exists():
        (tools / "redis-server").symlink_to(find_redis_binary())
    text = "\n".join(["set -euo pipefail", *lines]) + "\n"
    script = tmp_path / "doc.sh"
    script.write_text(text)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DATAGEN_")}
    env.update(
        HF_HUB_OFFLINE="1",
        PATH=os.pathsep.join([str(tools), str(Path(sys.executable).parent), env.get("PATH", "")]),
    )
    log = tmp_path / "doc.log"
    with log.open("wb") as out:
        shell = subprocess.Popen(
            ["bash", str(script)],
            cwd=home,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            code: int | None = shell.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            _stop_group(shell.pid)
            if shell.poll() is None:
                shell.kill()
                shell.wait()
    return ScriptRun(code, log.read_text("utf-8", errors="replace"), shell.pid, text)
