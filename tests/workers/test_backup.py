"""Backup requests (``workers.run.backup``): a straggler on a slow server raced on a fast idle one.

Real Redis, simulators over real HTTP. The worker tests run a burst ``Worker`` over a fast and a
slow simulator: the slow one's requests take seconds, so once the fast one has drained the backlog
they are backed up there. The race tests drive :class:`Backups` directly with real clients, to
pause or cancel at a chosen moment of a race.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import redis

from datagen.control.jobs import JobStore
from datagen.errors import RetryableError
from datagen.records.storage import Storage
from datagen.states import PromptClass
from simulator.sglang._service import REQUEST_STATE_WAIT_TIMEOUT_S
from tests.support.metrics import metric_value
from tests.support.sim import running_simulator
from tests.support.wait import wait_until_async
from tests.support.workers import KEYS, NOT_MET, WAIT_S, ingest, records, settings, start, stop
from workers.engines.base import GenerateResult
from workers.engines.http import ClientTimeouts
from workers.engines.sglang import SGLangClient
from workers.fleet.servers import Fleet, Server
from workers.metrics import WorkerMetrics
from workers.run.backup import Backups
from workers.worker import Worker

SHORT = PromptClass.SHORT
PROMPTS = 16
# A decode step costs 0.02 s x the time scale: about 0.02 s for 400 tokens on the fast server,
# 4 s on the slow one.
FAST_SCALE = 0.002
SLOW_SCALE = 0.5
# The race tests: a backup of 200 tokens takes about 0.4 s on "medium", the primary 2 s on "slow".
MEDIUM_SCALE = 0.1
RACE_TOKENS = 200
# A race a test stops or cancels once both requests run: the backup on "medium" runs about 1.2 s
# (0.4 s at RACE_TOKENS, which a loaded CI machine once let it win before the pause was seen), the
# primary on "slow" about 6 s.
LONG_RACE_TOKENS = 600
PROMPT_IDS = [1000 + i for i in range(20)]


@pytest.fixture
def servers(tokenizer_path: str) -> Iterator[dict[str, str]]:
    with (
        running_simulator(tokenizer_path=tokenizer_path, time_scale=FAST_SCALE) as fast,
        running_simulator(tokenizer_path=tokenizer_path, time_scale=SLOW_SCALE) as slow,
    ):
        yield {"fast": fast, "slow": slow}


@pytest.fixture
def race_servers(tokenizer_path: str) -> Iterator[dict[str, str]]:
    with (
        running_simulator(tokenizer_path=tokenizer_path, time_scale=MEDIUM_SCALE) as medium,
        running_simulator(tokenizer_path=tokenizer_path, time_scale=SLOW_SCALE) as slow,
    ):
        yield {"medium": medium, "slow": slow}


async def _run(worker: Worker) -> None:
    try:
        await worker.run()
    finally:
        await stop(worker)


def _backups(worker: Worker, outcome: str | None = None) -> float:
    counter = worker.metrics.backup_requests
    return sum(
        sample.value
        for metric in counter.collect()
        for sample in metric.samples
        if sample.name.endswith("_total") and outcome in (None, sample.labels["outcome"])
    )


async def _metric(url: str, name: str) -> float:
    async with httpx.AsyncClient() as client:
        return metric_value((await client.get(f"{url}/metrics")).text, name)


async def _running(url: str) -> float:
    return await _metric(url, "sglang:num_running_reqs")


async def _until_both_run(race: Race) -> None:
    """Until the primary and its backup both run on their servers."""

    async def both_run() -> bool:
        return [await _running(url) for url in race.urls.values()] == [1, 1]

    await wait_until_async(both_run, WAIT_S, "the backup did not start", interval_s=0.01)


async def _until_idle(*urls: str) -> None:
    """Until no request runs on these servers. A closed request is aborted when SGLang next polls
    for disconnects (``REQUEST_STATE_WAIT_TIMEOUT_S``, 4 s)."""

    async def idle() -> bool:
        return [await _running(url) for url in urls] == [0] * len(urls)

    await wait_until_async(
        idle, REQUEST_STATE_WAIT_TIMEOUT_S + 2, "a closed request still runs", interval_s=0.1
    )


async def test_a_backup_on_the_fast_server_wins_and_the_prompt_is_stored_and_counted_once(
    redis_client: redis.Redis, redis_url: str, storage: Storage, servers: dict[str, str]
) -> None:
    ingest(redis_client, storage, "bk", PROMPTS)
    worker = await start(settings(redis_url, storage), servers, burst=True)
    await _run(worker)

    rows = records(storage, "bk")
    assert sorted(r["sample_id"] for r in rows) == sorted(f"p{i}" for i in range(PROMPTS))
    progress = JobStore(redis_client, KEYS).progress("bk")
    assert (progress.done, progress.failed) == (PROMPTS, 0)
    won = [r for r in rows if r["rid"].endswith(f"b.{worker.tag}")]
    assert won, "no backup won: the slow server's prompts should have been raced on the fast one"
    assert _backups(worker, "won") == len(won)
    assert {r["server"] for r in won} == {"fast"}
    # A backup is the same attempt: it charges nothing.
    assert {r["attempts"] for r in rows} == {1}
    # The slow server's requests that lost were closed: SGLang aborts them (or drops the answer of
    # one that ends before it notices).
    await _until_idle(servers["slow"])


async def test_greedy_backups_produce_the_primarys_tokens(
    redis_client: redis.Redis, redis_url: str, storage: Storage, servers: dict[str, str]
) -> None:
    greedy = {"temperature": 0.0, "sampling_seed": 11}
    ingest(redis_client, storage, "raced", PROMPTS, sampling=greedy)
    worker = await start(settings(redis_url, storage), servers, burst=True)
    await _run(worker)
    # The same prompts on one server (the same model): every answer is a primary's.
    ingest(redis_client, storage, "alone", PROMPTS, sampling=greedy)
    alone = await start(settings(redis_url, storage), {"fast": servers["fast"]}, burst=True)
    await _run(alone)

    raced = {r["sample_id"]: r for r in records(storage, "raced")}
    primaries = {r["sample_id"]: r for r in records(storage, "alone")}
    won = [sid for sid, r in raced.items() if r["rid"].endswith(f"b.{worker.tag}")]
    assert won
    for sid in won:
        assert raced[sid]["input_ids"] == primaries[sid]["input_ids"], sid
        assert raced[sid]["sampling_params"] == primaries[sid]["sampling_params"]
        assert raced[sid]["max_new_tokens"] == primaries[sid]["max_new_tokens"] == 400


async def test_no_backups_when_they_are_turned_off(
    redis_client: redis.Redis, redis_url: str, storage: Storage, servers: dict[str, str]
) -> None:
    ingest(redis_client, storage, "off", PROMPTS)
    worker = await start(settings(redis_url, storage, backup_requests=False), servers, burst=True)
    await _run(worker)
    rows = records(storage, "off")
    assert len(rows) == PROMPTS
    assert not [r for r in rows if r["rid"].endswith(f"b.{worker.tag}")]
    assert _backups(worker) == 0
    assert {r["server"] for r in rows} == {"fast", "slow"}


# Racing, driven directly ------------------------------------------------------------------------
class Race:
    """A fleet of "medium" and "slow" with measured speeds, and :class:`Backups` over it."""

    def __init__(self, urls: dict[str, str], *, enabled: bool = True, rid: str = "r") -> None:
        limits = {SHORT: 4, PromptClass.LONG: 1}
        self.urls = urls
        self.rid = rid
        self.servers = {
            name: Server(name, SGLangClient(name, url, timeouts=ClientTimeouts(), max_connections=8), limits)
            for name, url in urls.items()
        }
        self.servers["medium"].observe(0.4, 200)  # 2 ms a token
        self.servers["slow"].observe(2.0, 200)  # 10 ms a token
        self.metrics = WorkerMetrics()
        self.fleet = Fleet(list(self.servers.values()), self.metrics)
        self.paused: set[PromptClass] = set()
        self.backups = Backups(
            self.fleet,
            self.metrics,
            enabled=enabled,
            is_paused=self.paused.__contains__,
            stop_check_interval_s=0.02,
        )

    async def start(
        self, tokens: int = RACE_TOKENS
    ) -> tuple[asyncio.Task[tuple[Server, GenerateResult]], Any]:
        """The primary of ``tokens`` on "slow", racing; returns its task and its straggler."""
        slow = self.servers["slow"]
        assert self.fleet.try_acquire(slow, SHORT)
        straggler = self.backups.track(slow, SHORT, max_new=tokens, fits=lambda s: True, avoid=frozenset())
        params = {"max_new_tokens": tokens, "ignore_eos": True, "temperature": 0.0}

        def call(server: Server, rid: str) -> Any:
            return server.client.generate(PROMPT_IDS, params, rid=rid)

        task = asyncio.create_task(
            self.backups.race(
                straggler,
                call(slow, f"{self.rid}.a1.t"),
                lambda s: call(s, f"{self.rid}.a1b.t"),
                name=self.rid,
            )
        )
        await asyncio.sleep(0.1)  # the primary runs
        return task, straggler

    def count(self, outcome: str) -> float:
        value = self.metrics.backup_requests.labels("medium", SHORT.value, outcome)._value.get()
        return float(value)

    async def close(self) -> None:
        await asyncio.gather(*(s.client.aclose() for s in self.servers.values()))


@pytest.fixture
async def race(race_servers: dict[str, str]) -> Any:
    race = Race(race_servers)
    yield race
    await race.close()


async def test_a_backup_races_and_the_first_answer_wins(race: Race, race_servers: dict[str, str]) -> None:
    task, straggler = await race.start()
    race.backups.on_claim_empty(SHORT)
    assert straggler.backup_server is race.servers["medium"]
    server, result = await asyncio.wait_for(task, 5)
    assert server.name == "medium" and len(result.output_ids) == RACE_TOKENS
    assert race.count("won") == 1
    # Both slots are free again (the primary's is the caller's to give back) and the slow request
    # was closed: the simulator aborts it.
    assert race.servers["medium"].in_flight[SHORT] == 0
    await _until_idle(race_servers["slow"])


async def test_a_paused_class_or_server_gets_no_backup_and_stops_a_running_one(
    race: Race, race_servers: dict[str, str]
) -> None:
    medium = race.servers["medium"]
    task, straggler = await race.start(LONG_RACE_TOKENS)
    race.paused.add(SHORT)
    race.backups.on_claim_empty(SHORT)
    race.paused.clear()
    medium.paused = True
    race.backups.on_claim_empty(SHORT)
    assert straggler.backup_server is None, "a paused class or server got a backup"
    medium.paused = False
    race.backups.on_claim_empty(SHORT)
    assert straggler.backup_server is medium
    await _until_both_run(race)
    race.paused.add(SHORT)
    await wait_until_async(
        lambda: race.count("stopped") == 1 and medium.in_flight[SHORT] == 0, WAIT_S, NOT_MET
    )
    await _until_idle(race_servers["medium"])
    server, result = await asyncio.wait_for(task, WAIT_S)
    assert server.name == "slow" and len(result.output_ids) == LONG_RACE_TOKENS
    assert race.count("won") == race.count("lost") == 0


async def test_a_server_leaving_stops_its_backup(race: Race, race_servers: dict[str, str]) -> None:
    medium = race.servers["medium"]
    task, _ = await race.start(LONG_RACE_TOKENS)
    race.backups.on_claim_empty(SHORT)
    await _until_both_run(race)
    await race.fleet.mark_down(medium, "test")
    await wait_until_async(
        lambda: race.count("stopped") == 1 and medium.in_flight[SHORT] == 0, WAIT_S, NOT_MET
    )
    await _until_idle(race_servers["medium"])
    server, _ = await asyncio.wait_for(task, WAIT_S)
    assert server.name == "slow"


async def test_cancelling_the_prompt_closes_both_requests(race: Race, race_servers: dict[str, str]) -> None:
    task, _ = await race.start(LONG_RACE_TOKENS)
    race.backups.on_claim_empty(SHORT)
    await _until_both_run(race)
    task.cancel()  # a job cancelled with --abort-in-flight cancels the prompt's task
    with pytest.raises(asyncio.CancelledError):
        await task
    assert race.count("cancelled") == 1
    assert race.servers["medium"].in_flight[SHORT] == 0
    await _until_idle(race_servers["medium"], race_servers["slow"])


async def test_no_backup_after_a_claim_finds_work_or_when_turned_off(race_servers: dict[str, str]) -> None:
    off = Race(race_servers, enabled=False, rid="off")
    on = Race(race_servers, rid="on")
    try:
        for race in (off, on):
            task, straggler = await race.start()
            if race is on:
                race.backups.on_claimed(SHORT)
                race.backups.freed(SHORT)  # a slot freed, but the backlog is not empty
            else:
                race.backups.on_claim_empty(SHORT)
            assert straggler.backup_server is None
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
    finally:
        await off.close()
        await on.close()


async def test_a_failed_backup_leaves_the_primary_running(race: Race) -> None:
    slow = race.servers["slow"]
    assert race.fleet.try_acquire(slow, SHORT)
    straggler = race.backups.track(slow, SHORT, max_new=RACE_TOKENS, fits=lambda s: True, avoid=frozenset())

    async def primary() -> str:
        await asyncio.sleep(0.2)
        return "primary"

    async def backup(server: Server) -> str:
        raise RetryableError("boom")

    race_task = asyncio.create_task(race.backups.race(straggler, primary(), backup, name="f"))
    await asyncio.sleep(0.01)
    race.backups.on_claim_empty(SHORT)
    server, answer = await asyncio.wait_for(race_task, 5)
    assert (server.name, answer) == ("slow", "primary")
    assert race.count("failed") == 1
    assert race.servers["medium"].in_flight[SHORT] == 0
