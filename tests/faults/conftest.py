"""Fixtures of the fault-injection suite: a factory of process stacks, all stopped after the test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.faults import FaultStack


@pytest.fixture
def make_stack(tmp_path: Path) -> Iterator[Callable[..., FaultStack]]:
    stacks: list[FaultStack] = []

    def make(namespace: str, env: dict[str, str] | None = None, **options: Any) -> FaultStack:
        root = tmp_path / f"stack{len(stacks)}"
        root.mkdir()
        stack = FaultStack(root, namespace, env, **options)
        stacks.append(stack)
        return stack

    yield make
    for stack in stacks:
        stack.stop()
