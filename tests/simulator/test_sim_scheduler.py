"""The scheduler on its own: admission, KV accounting, retraction, aborts, pacing."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from simulator import SimConfig
from simulator.model import SpecialIds, expected_output
from simulator.scheduler import Engine, Outcome, SimRequest
from simulator.sglang.metrics import SimMetrics
from tests.support.metrics import metric
from tests.support.sim import NOT_REACHED, WAIT_POLL_S, WAIT_S
from tests.support.wait import wait_until_async

SPECIAL = SpecialIds.deepseek_default()


def make_request(
    rid: str, *, prompt_len: int = 10, max_new_tokens: int = 200, ignore_eos: bool = False, **kw: Any
) -> SimRequest:
    output = expected_output(
        list(range(prompt_len)),
        max_new_tokens=max_new_tokens,
        seed=sum(map(ord, rid)),
        special=SPECIAL,
        ignore_eos=ignore_eos,
    )
    return SimRequest(rid=rid, prompt_len=prompt_len, max_new_tokens=max_new_tokens, output=output, **kw)


@pytest.fixture
async def engine_factory() -> AsyncIterator[Any]:
    engines: list[Engine] = []

    def factory(**overrides: Any) -> tuple[Engine, SimMetrics]:
        config = SimConfig(**{"time_scale": 0.0, **overrides})
        metrics = SimMetrics(config.served_model_name)
        engine = Engine(config, metrics)
        engine.start()
        engines.append(engine)
        return engine, metrics

    yield factory
    for engine in engines:
        await engine.close()


async def test_requests_finish_with_their_planned_output(engine_factory: Any) -> None:
    engine, metrics = engine_factory()
    reqs = [make_request(f"r{i}") for i in range(20)]
    for req in reqs:
        engine.submit(req)
    await asyncio.gather(*(r.done.wait() for r in reqs))
    for req in reqs:
        assert req.outcome is Outcome.FINISHED
        assert req.output_ids == req.output.output_ids
        assert req.first_token_at is not None and req.finished_at is not None
    assert engine.used_tokens == 0
    text = metrics.exposition().decode()
    assert metric(text, "sglang:num_requests_total") == 20
    assert metric(text, "sglang:generation_tokens_total") == sum(len(r.output_ids) for r in reqs)
    assert metric(text, "sglang:prompt_tokens_total") == 200


async def test_admission_blocks_the_fifo_head_when_reservations_are_full(engine_factory: Any) -> None:
    # Each request reserves 10 + 200 tokens; three fit in 700.
    engine, metrics = engine_factory(max_total_num_tokens=700, time_scale=1.0, decode_step_base_s=0.01)
    reqs = [make_request(f"r{i}") for i in range(6)]
    for req in reqs:
        engine.submit(req)
    await wait_until_async(lambda: engine.num_running == 3, WAIT_S, NOT_REACHED, interval_s=WAIT_POLL_S)
    assert engine.num_queued == 3
    assert [r._running for r in reqs] == [True, True, True, False, False, False]
    text = metrics.exposition().decode()
    assert metric(text, "sglang:num_queue_reqs") == 3
    assert metric(text, "sglang:num_running_reqs") == 3
    engine.abort("r", abort_all=False)


async def test_max_running_requests_caps_the_batch(engine_factory: Any) -> None:
    engine, _ = engine_factory(max_running_requests=2, time_scale=1.0, decode_step_base_s=0.01)
    for i in range(5):
        engine.submit(make_request(f"r{i}"))
    await wait_until_async(lambda: engine.num_running == 2, WAIT_S, NOT_REACHED, interval_s=WAIT_POLL_S)
    assert engine.num_queued == 3
    engine.abort("", abort_all=True)


async def test_kv_usage_is_counted_in_tokens(engine_factory: Any) -> None:
    engine, metrics = engine_factory(max_total_num_tokens=1000, time_scale=1.0, decode_step_base_s=0.01)
    req = make_request("one", prompt_len=100, max_new_tokens=500, ignore_eos=True)
    engine.submit(req)
    await wait_until_async(lambda: req.generated >= 3, WAIT_S, NOT_REACHED, interval_s=WAIT_POLL_S)
    assert engine.used_tokens == 100 + req.generated
    assert engine.token_usage == round((100 + req.generated) / 1000, 2)
    text = metrics.exposition().decode()
    assert metric(text, "sglang:num_used_tokens") >= 103
    assert metric(text, "sglang:max_total_num_tokens") == 1000
    engine.abort("one")


async def test_overflow_retracts_the_newest_and_outputs_stay_exact(engine_factory: Any) -> None:
    # Reserving nothing admits everyone at once; the pool then overflows during decode.
    engine, metrics = engine_factory(max_total_num_tokens=600, reserve_fraction=0.0)
    reqs = [make_request(f"r{i}", prompt_len=50, max_new_tokens=300, ignore_eos=True) for i in range(4)]
    for req in reqs:
        engine.submit(req)
    await asyncio.gather(*(r.done.wait() for r in reqs))
    assert all(r.outcome is Outcome.FINISHED for r in reqs)
    assert all(r.output_ids == r.output.output_ids for r in reqs)
    retracted = metric(metrics.exposition().decode(), "sglang:num_retracted_requests_total")
    assert retracted >= 1
    assert sum(r.num_retractions for r in reqs) == retracted
    assert reqs[0].num_retractions == 0  # the oldest is never the victim
    assert engine.used_tokens == 0


async def test_a_lone_request_that_cannot_fit_runs_out_of_memory(engine_factory: Any) -> None:
    engine, _ = engine_factory(max_total_num_tokens=100)
    req = make_request("big", prompt_len=50, max_new_tokens=400, ignore_eos=True)
    engine.submit(req)
    await req.done.wait()
    assert req.outcome is Outcome.OUT_OF_MEMORY
    assert engine.used_tokens == 0


async def test_abort_matches_rid_prefixes_in_both_queues(engine_factory: Any) -> None:
    engine, metrics = engine_factory(max_running_requests=1, time_scale=1.0, decode_step_base_s=0.01)
    running, waiting, other = (make_request(rid, ignore_eos=True) for rid in ("job1_0", "job1_1", "job2_0"))
    for req in (running, waiting, other):
        engine.submit(req)
    await wait_until_async(lambda: running.generated >= 2, WAIT_S, NOT_REACHED, interval_s=WAIT_POLL_S)
    assert engine.abort("job1") == 2
    assert running.outcome is Outcome.ABORTED_RUNNING
    assert running.output_ids == running.output.output_ids[: running.generated]
    assert waiting.outcome is Outcome.ABORTED_WAITING
    assert other.outcome is None
    assert engine.abort("") == 0  # an empty rid is ignored unless abort_all
    assert engine.abort("nope") == 0
    assert metric(metrics.exposition().decode(), "sglang:num_aborted_requests_total") == 2
    engine.abort("", abort_all=True)
    assert other.outcome is Outcome.ABORTED_WAITING or other.outcome is Outcome.ABORTED_RUNNING


async def test_an_injected_abort_stops_partway(engine_factory: Any) -> None:
    engine, _ = engine_factory()
    req = make_request("r", abort_after=7, ignore_eos=True)
    engine.submit(req)
    await req.done.wait()
    assert req.outcome is Outcome.ABORTED_RUNNING
    assert req.output_ids == req.output.output_ids[:7]


async def test_duplicate_rids_are_refused(engine_factory: Any) -> None:
    engine, _ = engine_factory(time_scale=1.0)
    engine.submit(make_request("same"))
    with pytest.raises(ValueError, match="Duplicate request ID detected: same"):
        engine.submit(make_request("same"))
    engine.abort("same")


async def test_zero_max_new_tokens_finishes_after_prefill(engine_factory: Any) -> None:
    engine, _ = engine_factory()
    req = make_request("zero", max_new_tokens=0)
    engine.submit(req)
    await req.done.wait()
    assert req.outcome is Outcome.FINISHED
    assert req.output_ids == []


async def test_time_scale_paces_decode_steps(engine_factory: Any) -> None:
    # 20 steps of 10 ms each at batch 1 take about 0.2 s; at time_scale 0 they take ~nothing.
    engine, _ = engine_factory(time_scale=1.0, decode_step_base_s=0.01, decode_step_per_req_s=0.0)
    req = make_request("paced", max_new_tokens=21, ignore_eos=True)
    started = time.monotonic()
    engine.submit(req)
    await req.done.wait()
    assert 0.18 <= time.monotonic() - started < 0.6


async def test_a_clock_allowed_to_lag_catches_up_on_late_wake_ups(engine_factory: Any) -> None:
    # 100 decode steps of 1.5 ms: asyncio's timer wakes a 1.5-ms sleep after 2 ms or more, and a
    # clock that never lags keeps every such delay; one that may lag 5 ms catches up.
    async def paced_s(max_lag_s: float) -> float:
        engine, _ = engine_factory(
            time_scale=1.0, decode_step_base_s=0.0015, decode_step_per_req_s=0.0, max_lag_s=max_lag_s
        )
        req = make_request(f"lag-{max_lag_s}", max_new_tokens=101, ignore_eos=True)
        started = time.monotonic()
        engine.submit(req)
        await req.done.wait()
        return time.monotonic() - started

    strict_s = await paced_s(0.0)
    lagging_s = await paced_s(0.005)
    assert strict_s >= 0.19  # at least 2 ms a step
    assert 0.14 <= lagging_s < 0.9 * strict_s


async def test_gen_throughput_is_reported_while_busy(engine_factory: Any) -> None:
    engine, metrics = engine_factory(time_scale=1.0, decode_step_base_s=0.001, decode_step_per_req_s=0.0)
    reqs = [make_request(f"r{i}", max_new_tokens=2000, ignore_eos=True) for i in range(4)]
    for req in reqs:
        engine.submit(req)
    await wait_until_async(lambda: engine.gen_throughput > 0, WAIT_S, NOT_REACHED, interval_s=WAIT_POLL_S)
    assert metric(metrics.exposition().decode(), "sglang:gen_throughput") > 0
    engine.abort("", abort_all=True)
    await wait_until_async(lambda: engine.gen_throughput == 0, WAIT_S, NOT_REACHED, interval_s=WAIT_POLL_S)


async def test_close_releases_every_waiter(engine_factory: Any) -> None:
    engine, _ = engine_factory(time_scale=1.0, max_running_requests=1)
    reqs = [make_request(f"r{i}") for i in range(3)]
    for req in reqs:
        engine.submit(req)
    await wait_until_async(lambda: engine.num_running == 1, WAIT_S, NOT_REACHED, interval_s=WAIT_POLL_S)
    await engine.close()
    assert all(r.done.is_set() for r in reqs)
    assert {r.outcome for r in reqs} == {Outcome.ABORTED_RUNNING, Outcome.ABORTED_WAITING}
