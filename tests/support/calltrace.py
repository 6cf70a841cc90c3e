"""Which of our modules ran, and which called which, traced in every thread.

:class:`CallTrace` is a profile function (``sys.setprofile`` and ``threading.setprofile``). While it
records, it notes each module of ours whose function, method, generator or coroutine body ran (a
module's import, its top level and class bodies, is not a run) and, for each such call, the module
that made it: the nearest frame further up the stack whose module counts, looking through libraries
and modules that do not count. Where the stack holds none, the call came over a hand-off, and the
caller is where the hand-off began: for an asyncio task, where its coroutine was created; for a
thread, where it was started; for a thread pool's work item, where it was submitted.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import sys
import threading
import weakref
from collections.abc import Callable, Collection, Iterator
from concurrent.futures import thread as pool
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

__all__ = ["CallTrace"]

# How many frames a coroutine remembers of where it was created (`cr_origin`).
ORIGIN_DEPTH = 16
# Where a hand-off begins (its `self` is the thread or work item) and where it is taken up.
HANDING = frozenset({threading.Thread.start.__code__, pool._WorkItem.__init__.__code__})
TAKING = frozenset({threading.Thread.run.__code__, pool._WorkItem.run.__code__})
THREAD_RUN = threading.Thread.run.__code__


class _Ignored:
    """The caller of a call made under an ignored frame."""


IGNORED = _Ignored()


class CallTrace:
    """Installed (``with CallTrace(...)``) before the threads to trace start, since
    ``threading.setprofile`` reaches only threads started later; records inside :meth:`recording`.

    ``root`` and ``packages`` say which files are ours (a module is named by its path under ``root``:
    ``service/app.py``), ``counts`` which of them count; nothing that runs under a frame of
    ``ignored`` (a process's own timer loops, say), or in a task or thread begun there, is recorded.
    """

    def __init__(
        self,
        root: Path,
        packages: Collection[str],
        *,
        counts: Callable[[str], bool],
        ignored: Collection[CodeType] = (),
    ) -> None:
        self._root = root
        self._packages = frozenset(packages)
        self._counts = counts
        self._ignored = frozenset(ignored)
        self._ignored_names = frozenset((code.co_filename, code.co_name) for code in ignored)
        self._modules: dict[str, str | None] = {}
        self._origins: weakref.WeakKeyDictionary[object, str | _Ignored] = weakref.WeakKeyDictionary()
        self._recording = False
        self._paused = threading.local()
        self._depth = 0
        # Every counted module that ran, in the order each first ran.
        self.ran: dict[str, None] = {}
        # The functions of each that ran (qualified names), in the order each first ran.
        self.functions: dict[str, dict[str, None]] = {}
        # (caller, callee): the calls from one counted module into another.
        self.calls: set[tuple[str, str]] = set()

    def _module(self, filename: str) -> str | None:
        """The counted module of ``filename``, if it is one."""
        if filename not in self._modules:
            path = Path(filename)
            name = None
            if path.suffix == ".py" and path.is_relative_to(self._root):
                relative = path.relative_to(self._root).as_posix()
                if relative.split("/")[0] in self._packages and self._counts(relative):
                    name = relative
            self._modules[filename] = name
        return self._modules[filename]

    def _caller(self, frame: FrameType | None) -> str | _Ignored | None:
        caller: str | _Ignored | None = None
        while frame is not None:
            code = frame.f_code
            if code in self._ignored:
                return IGNORED
            if caller is None:
                if code in TAKING:
                    caller = self._origins.get(frame.f_locals["self"])
                    if caller is IGNORED:
                        return IGNORED
                else:
                    caller = self._module(code.co_filename)
            frame = frame.f_back
        return caller if caller is not None else self._task_origin()

    def _task_origin(self) -> str | _Ignored | None:
        """Where the running asyncio task's coroutine was created, if in a counted module."""
        try:
            task = asyncio.current_task()
        except RuntimeError:  # no event loop in this thread
            return None
        origin = getattr(task.get_coro(), "cr_origin", None) if task is not None else None
        for filename, _, name in origin or ():
            if (filename, name) in self._ignored_names:
                return IGNORED
            module = self._module(filename)
            if module is not None:
                return module
        return None

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return
        code = frame.f_code
        if code is THREAD_RUN:
            # A thread started under the trace: coroutines created in it remember where too.
            sys.set_coroutine_origin_tracking_depth(ORIGIN_DEPTH)
        elif code in HANDING:
            origin = self._caller(frame.f_back)
            if origin is not None:
                self._origins[frame.f_locals["self"]] = origin
            return
        # Only bodies with their own locals: functions, methods, generators, coroutines, lambdas.
        if (
            not self._recording
            or getattr(self._paused, "on", False)
            or not code.co_flags & inspect.CO_NEWLOCALS
        ):
            return
        module = self._module(code.co_filename)
        if module is None or code in self._ignored:
            return
        caller = self._caller(frame.f_back)
        if caller is IGNORED:
            return
        self.ran.setdefault(module)
        self.functions.setdefault(module, {}).setdefault(code.co_qualname)
        if isinstance(caller, str) and caller != module:
            self.calls.add((caller, module))

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        self._recording = True
        try:
            yield
        finally:
            self._recording = False

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Nothing this thread runs meanwhile is recorded (a test looking on, say)."""
        self._paused.on = True
        try:
            yield
        finally:
            self._paused.on = False

    def __enter__(self) -> CallTrace:
        # Coroutines created in this thread remember where (and in threads started later: __call__).
        self._depth = sys.get_coroutine_origin_tracking_depth()
        sys.set_coroutine_origin_tracking_depth(ORIGIN_DEPTH)
        threading.setprofile(self)
        sys.setprofile(self)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.setprofile(None)
        threading.setprofile(None)
        sys.set_coroutine_origin_tracking_depth(self._depth)
