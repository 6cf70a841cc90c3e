"""Which jobs exist: the job index (a sorted set by creation time) read a page at a time, newest
first, with cursors that hold however many jobs are made or deleted between pages, and filtered by
state and priority (`GET /jobs`, `datagen status`, the coordinator's resume, the metrics scrape).
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterator, Sequence
from typing import Protocol, cast

from redis import Redis

from datagen.control.keys import Keys
from datagen.control.redistext import as_text, as_texts
from datagen.errors import InvalidRequestError
from datagen.records.layout import JOB_ID_PATTERN
from datagen.states import JobState

__all__ = ["JobIndex"]

# A page of job ids reads this many more, for jobs made in the same millisecond as the cursor's.
PAGE_TIES = 64
# A filtered listing (`JobIndex.select`) reads jobs this many at a time, and at most SELECT_SCAN per
# call, so it stays fast however few jobs match.
SELECT_PAGE = 500
SELECT_SCAN = 5000
# A cursor: `<created ms>:<job id>`, as `JobIndex.page` writes it (a job id as `JOB_ID_PATTERN`).
CURSOR_MS_DIGITS = 16
_CURSOR = re.compile(rf"(?P<ms>[0-9]{{1,{CURSOR_MS_DIGITS}}}):(?P<after>{JOB_ID_PATTERN.pattern})")


class JobStates(Protocol):
    """What the index asks of the jobs' hashes (`datagen.control.jobs.JobStore`, their one reader)."""

    def states(self, job_ids: Sequence[str]) -> list[tuple[str, str] | None]: ...


class JobIndex:
    """The index of one namespace's jobs; a job's own fields are read through ``jobs``."""

    def __init__(self, redis: Redis, keys: Keys, jobs: JobStates) -> None:
        self.redis = redis
        self.keys = keys
        self.jobs = jobs

    def select(
        self,
        limit: int,
        cursor: str | None = None,
        *,
        states: Collection[JobState] = (),
        priorities: Collection[str] = (),
    ) -> tuple[list[str], str | None]:
        """Like :meth:`page`, keeping only jobs in ``states`` and at ``priorities`` (empty: any).
        Reads at most ``SELECT_SCAN`` jobs per call: a filter that matches few of many jobs
        answers a short (even empty) page with a ``next`` to go on from, never a slow one."""
        if not states and not priorities:
            return self.page(limit, cursor)
        wanted_states = {state.value for state in states}
        wanted_priorities = set(priorities)
        picked: list[str] = []
        scanned = 0
        while True:
            ids, cursor = self.page(min(SELECT_PAGE, SELECT_SCAN - scanned), cursor)
            scanned += len(ids)
            for job_id, facts in zip(ids, self.jobs.states(ids), strict=True):
                if facts is None:
                    continue
                state, priority = facts
                if wanted_states and state not in wanted_states:
                    continue
                if wanted_priorities and priority not in wanted_priorities:
                    continue
                picked.append(job_id)
                if len(picked) == limit:
                    return picked, self._cursor_at(job_id) if job_id != ids[-1] or cursor else None
            if cursor is None or scanned >= SELECT_SCAN:
                return picked, cursor

    def _cursor_at(self, job_id: str) -> str:
        score = self.redis.zscore(self.keys.jobs_index(), job_id)
        return f"{int(score or 0)}:{job_id}"

    def list_ids(self, limit: int = 1000) -> list[str]:
        """The newest ``limit`` job ids (see :meth:`iter_ids` and :meth:`page` for all of them)."""
        return as_texts(self.redis.zrevrange(self.keys.jobs_index(), 0, limit - 1))

    def count(self) -> int:
        return int(self.redis.zcard(self.keys.jobs_index()))

    def iter_ids(self, page: int = 1000) -> Iterator[str]:
        """Every job id, newest first, read ``page`` at a time (however many jobs there are)."""
        for ids, _ in self._pages(page):
            yield from ids

    def _pages(self, page: int) -> Iterator[tuple[list[str], str | None]]:
        cursor: str | None = None
        while True:
            ids, cursor = self.page(page, cursor)
            yield ids, cursor
            if cursor is None:
                return

    def page(self, limit: int, cursor: str | None = None) -> tuple[list[str], str | None]:
        """Up to ``limit`` job ids, newest first, after ``cursor`` (None: from the newest); and the
        cursor of the next page (None: this was the last). A cursor is ``<created ms>:<job id>``:
        jobs made or deleted between pages neither repeat nor hide others. A malformed cursor
        raises InvalidRequestError."""
        cursor_ms, after = _parse_cursor(cursor) if cursor is not None else (0, "")
        key = self.keys.jobs_index()
        if cursor is None:
            raw = self.redis.zrevrange(key, 0, limit - 1, withscores=True)
        else:
            # Ties in the score come in reverse id order; at most a few share one millisecond.
            raw = self.redis.zrevrangebyscore(
                key, cursor_ms, "-inf", start=0, num=limit + PAGE_TIES, withscores=True
            )
        rows = [(as_text(member), int(score)) for member, score in cast(list[tuple[bytes, float]], raw)]
        if cursor is not None:
            rows = [(m, sc) for m, sc in rows if not (sc == cursor_ms and m >= after)][:limit]
        ids = [member for member, _ in rows]
        if len(rows) < limit:
            return ids, None
        last_member, last_score = rows[-1]
        return ids, f"{last_score}:{last_member}"


def _parse_cursor(cursor: str) -> tuple[int, str]:
    # ASCII digits only: str.isdigit() also accepts "²", which int() then refuses.
    match = _CURSOR.fullmatch(cursor)
    if match is None:
        raise InvalidRequestError(
            f"bad cursor {cursor[:80]!r}: pass the `next` of the previous page of GET /jobs unchanged "
            "(<created ms>:<job id>)"
        )
    return int(match["ms"]), match["after"]
