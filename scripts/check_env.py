"""What scripts/check says about its environment before it runs anything.

``--versions`` prints the interpreter and the installed version of every package the project asks
for (runtime and ``test`` extra), so a failing check's log says what it ran with.
``--lock FILE`` compares every installed distribution with the lock: one that the lock does not pin
at its installed version is listed, and with ``--strict`` the check stops there (a venv made by this
run holds only what the lock and pyproject.toml asked for, so a package the lock misses means
pyproject.toml changed without ``scripts/lock``).
"""

from __future__ import annotations

import argparse
import platform
import re
import sys
import textwrap
from importlib import metadata
from pathlib import Path

PROJECT = "eagle3-datagen"
LINE_WIDTH = 100


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_names() -> list[str]:
    names = []
    for requirement in metadata.requires(PROJECT) or []:
        match = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement)
        if match and _canonical(match.group(0)) not in {_canonical(n) for n in names}:
            names.append(match.group(0))
    return names


def print_versions() -> None:
    found = []
    for name in _requirement_names():
        try:
            found.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            found.append(f"{name} (missing)")
    print(f"Python {platform.python_version()} ({sys.executable})")
    print(textwrap.fill(", ".join(found), LINE_WIDTH, break_on_hyphens=False))


def _pins(lock: Path) -> dict[str, str]:
    pins = {}
    for raw in lock.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            pins[_canonical(name)] = version.split(";", 1)[0].strip()
    return pins


def unpinned(lock: Path) -> list[str]:
    """Installed distributions the lock does not pin at their installed version."""
    pins = _pins(lock)
    ignored = {_canonical(PROJECT), "pip", "setuptools", "wheel"}
    off = []
    for dist in metadata.distributions():
        name = _canonical(dist.metadata["Name"])
        if name in ignored:
            continue
        if pins.get(name) != dist.version:
            pinned = pins.get(name)
            off.append(
                f"{name} {dist.version} ({'not in the lock' if pinned is None else f'lock: {pinned}'})"
            )
    return sorted(set(off))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--versions", action="store_true", help="print the interpreter and package versions")
    parser.add_argument("--lock", type=Path, help="list installed packages this lock does not pin")
    parser.add_argument("--strict", action="store_true", help="with --lock: exit 1 if any is listed")
    args = parser.parse_args()
    if args.versions:
        print_versions()
    if args.lock is None:
        return 0
    off = unpinned(args.lock)
    if not off:
        return 0
    verdict = "error" if args.strict else "warning"
    print(f"{verdict}: installed but not pinned by {args.lock}: {', '.join(off)}", file=sys.stderr)
    if args.strict:
        print(f"run scripts/lock, review {args.lock}'s diff and commit it", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
