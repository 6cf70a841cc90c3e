"""The KV controller's decisions and its reading of SGLang's /metrics, in both name forms."""

from __future__ import annotations

from workers.engines.base import KvSignals
from workers.engines.sglang_replies import parse_kv_signals
from workers.fleet.kv_policy import Decision, decide, restarted

# Written after SGLang's exposition (shared/reference/sglang-contract.md §5): colon names, DP ranks.
COLON_PAGE = """\
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="m",engine_type="unified",tp_rank="0",pp_rank="0",dp_rank="0"} 0.91
sglang:token_usage{model_name="m",engine_type="unified",tp_rank="0",pp_rank="0",dp_rank="1"} 0.95
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="m",dp_rank="0"} 7
sglang:num_queue_reqs{model_name="m",dp_rank="1"} 5
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m",dp_rank="0"} 100
sglang:num_running_reqs{model_name="m",dp_rank="1"} 90
# HELP sglang:num_retracted_requests_total Retracted requests.
# TYPE sglang:num_retracted_requests_total counter
sglang:num_retracted_requests_total{model_name="m"} 4
sglang:num_retracted_requests_created{model_name="m"} 1.7e9
# HELP sglang:max_total_num_tokens Capacity.
# TYPE sglang:max_total_num_tokens gauge
sglang:max_total_num_tokens{model_name="m"} 200000
# HELP sglang:num_requests_total Requests processed.
# TYPE sglang:num_requests_total counter
sglang:num_requests_total{model_name="m"} 1234
"""


def test_parse_colon_form_sums_dp_ranks_and_takes_the_fullest_pool() -> None:
    signals = parse_kv_signals(COLON_PAGE)
    assert signals == KvSignals(
        token_usage=0.95,
        num_queue_reqs=12,
        num_running_reqs=190,
        retracted_total=4,
        max_total_num_tokens=200000,
        requests_total=1234,
    )


def test_parse_underscore_form() -> None:
    page = COLON_PAGE.replace("sglang:", "sglang_")
    assert parse_kv_signals(page) == parse_kv_signals(COLON_PAGE)


def test_parse_page_without_sglang_metrics() -> None:
    assert parse_kv_signals("# TYPE other gauge\nother 1\n") == KvSignals()


def test_retractions_cut_the_target() -> None:
    before = KvSignals(token_usage=0.9, retracted_total=10, num_running_reqs=100)
    after = KvSignals(token_usage=0.99, retracted_total=13, num_running_reqs=100)
    decision = decide(200, before, after, floor=10, ceiling=512)
    assert decision.target == 140
    assert decision.reason is not None and "3 retractions" in decision.reason


def test_a_restarted_server_is_not_a_retraction() -> None:
    before = KvSignals(retracted_total=50, num_running_reqs=10)
    after = KvSignals(retracted_total=0, num_running_reqs=10, num_queue_reqs=0, token_usage=0.2)
    assert decide(100, before, after, floor=1, ceiling=100).reason is None  # binding 10 < 90: hold


def test_a_server_queue_beyond_the_setpoint_cuts_the_target_by_the_excess() -> None:
    # 25 run, 8 wait, 1 is on its way: the setpoint is four requests, so four too many wait.
    signals = KvSignals(token_usage=0.6, num_queue_reqs=8, num_running_reqs=25)
    decision = decide(34, None, signals, floor=1, ceiling=512)
    assert decision.target == 30
    assert decision.reason == "8 requests waiting in the server queue beside 25 running"
    # Four waiting is the setpoint: hold; five is one too many.
    at_setpoint = KvSignals(token_usage=0.6, num_queue_reqs=4, num_running_reqs=28)
    assert decide(32, None, at_setpoint, floor=1, ceiling=512).reason is None
    one_over = KvSignals(token_usage=0.6, num_queue_reqs=5, num_running_reqs=28)
    assert decide(33, None, one_over, floor=1, ceiling=512).target == 32
    # A big server: the setpoint is 3 % of those running (5.4 of 180).
    big = KvSignals(token_usage=0.9, num_queue_reqs=10, num_running_reqs=180)
    assert decide(200, None, big, floor=10, ceiling=512).target == 195


def test_a_target_far_above_what_the_server_holds_comes_down_at_once() -> None:
    # Others fill the queue while this target is mostly unused: down to what the server holds
    # (100 running, 20 waiting) plus the setpoint (4).
    signals = KvSignals(token_usage=0.97, num_queue_reqs=20, num_running_reqs=100)
    assert decide(512, None, signals, floor=10, ceiling=512).target == 124


def test_headroom_grows_only_when_the_target_is_in_use() -> None:
    busy = KvSignals(token_usage=0.5, num_queue_reqs=0, num_running_reqs=95)
    assert decide(100, None, busy, floor=1, ceiling=512).target == 105
    idle = KvSignals(token_usage=0.5, num_queue_reqs=0, num_running_reqs=20)
    assert decide(100, None, idle, floor=1, ceiling=512).reason is None
    full = KvSignals(token_usage=0.95, num_queue_reqs=0, num_running_reqs=100)
    assert decide(100, None, full, floor=1, ceiling=512).reason is None


def test_floor_and_ceiling_bound_every_decision() -> None:
    storm = KvSignals(retracted_total=1000, num_running_reqs=1)
    assert decide(12, KvSignals(retracted_total=0), storm, floor=10, ceiling=512).target == 10
    busy = KvSignals(token_usage=0.1, num_running_reqs=510)
    assert decide(510, None, busy, floor=1, ceiling=512).target == 512
    assert decide(512, None, busy, floor=1, ceiling=512).reason is None


def test_below_the_setpoint_the_target_grows_by_the_shortfall_or_five_percent() -> None:
    empty = KvSignals(token_usage=0.5, num_queue_reqs=0, num_running_reqs=30)
    assert decide(30, None, empty, floor=1, ceiling=512).target == 34  # four short of the setpoint
    # Right after a queue too: the queue is gone, so the server has room nothing fills.
    after_a_queue = KvSignals(token_usage=0.6, num_queue_reqs=3, num_running_reqs=30)
    assert decide(30, after_a_queue, empty, floor=1, ceiling=512).target == 34
    one_short = KvSignals(token_usage=0.5, num_queue_reqs=3, num_running_reqs=30)
    assert decide(31, None, one_short, floor=1, ceiling=512).target == 33  # 5 % of 31, rounded up
    assert (
        decide(100, None, KvSignals(token_usage=0.5, num_running_reqs=95), floor=1, ceiling=512).target == 105
    )


# Slow start ------------------------------------------------------------------------------------


def test_slow_start_grows_by_half_while_the_window_is_used_and_nothing_waits() -> None:
    used = KvSignals(token_usage=0.1, num_queue_reqs=0, num_running_reqs=16)
    assert decide(16, None, used, floor=1, ceiling=512, slow_start=True) == Decision(
        24, "slow start: 16 running, 0 waiting, KV usage 10%", slow_start=True
    )
    # Three more quiet samples: 24 -> 36 -> 54 -> 81.
    target = 24
    for expected in (36, 54, 81):
        signals = KvSignals(token_usage=0.1, num_running_reqs=target)
        target = decide(target, None, signals, floor=1, ceiling=512, slow_start=True).target
        assert target == expected


def test_slow_start_waits_for_demand_instead_of_growing() -> None:
    idle = KvSignals(token_usage=0.01, num_queue_reqs=0, num_running_reqs=3)
    assert decide(16, None, idle, floor=1, ceiling=512, slow_start=True) == Decision(
        16, None, slow_start=True
    )


def test_slow_start_growth_is_capped_where_the_pool_would_be_full() -> None:
    # 40 running use 80 % of the pool: about 45 fit at 90 %, not 60.
    signals = KvSignals(token_usage=0.8, num_queue_reqs=0, num_running_reqs=40)
    assert decide(40, None, signals, floor=1, ceiling=512, slow_start=True).target == 45
    # Never less than one more while slow start goes on.
    full_ish = KvSignals(token_usage=0.89, num_queue_reqs=0, num_running_reqs=40)
    assert decide(40, None, full_ish, floor=1, ceiling=512, slow_start=True).target == 41


def test_a_server_queue_ends_slow_start_and_cuts_the_excess() -> None:
    signals = KvSignals(token_usage=0.5, num_queue_reqs=10, num_running_reqs=50)
    decision = decide(64, None, signals, floor=1, ceiling=512, slow_start=True)
    assert decision.target == 58  # 6 beyond the setpoint of four
    assert not decision.slow_start
    assert decision.reason == (
        "slow start ends at 64: 10 requests waiting in the server queue beside 50 running"
    )


def test_high_kv_usage_ends_slow_start_without_a_change() -> None:
    signals = KvSignals(token_usage=0.95, num_queue_reqs=0, num_running_reqs=30)
    assert decide(32, None, signals, floor=1, ceiling=512, slow_start=True) == Decision(
        32, "slow start ends at 32: KV usage 95%"
    )


def test_retractions_end_slow_start_with_a_cut() -> None:
    before = KvSignals(token_usage=0.5, retracted_total=5, num_running_reqs=40)
    after = KvSignals(token_usage=0.7, retracted_total=7, num_running_reqs=40)
    decision = decide(40, before, after, floor=1, ceiling=512, slow_start=True)
    assert (decision.target, decision.slow_start) == (28, False)


def test_slow_start_ends_at_the_ceiling() -> None:
    used = KvSignals(token_usage=0.2, num_running_reqs=60)
    assert decide(60, None, used, floor=1, ceiling=80, slow_start=True).target == 80  # not 90
    assert decide(80, None, used, floor=1, ceiling=80, slow_start=True) == Decision(
        80, "slow start ends at the ceiling 80"
    )


def test_a_job_of_one_class_uses_only_that_class_share_of_the_target() -> None:
    # Target 100 over both classes; the long class's share of this worker's slots is 10, and the
    # server runs 9 long prompts: that is the target in use, though 9 is far below 100.
    signals = KvSignals(token_usage=0.2, num_queue_reqs=0, num_running_reqs=9)
    assert decide(100, None, signals, floor=1, ceiling=512, slow_start=True, usable=10).target == 150
    assert decide(100, None, signals, floor=1, ceiling=512, slow_start=True).reason is None


def test_a_counter_that_went_down_is_a_restart() -> None:
    before = KvSignals(requests_total=500, retracted_total=3)
    assert restarted(before, KvSignals(requests_total=2, retracted_total=3))
    assert restarted(before, KvSignals(requests_total=501, retracted_total=0))
    assert not restarted(before, KvSignals(requests_total=501, retracted_total=3))
    assert not restarted(None, KvSignals(requests_total=0))
    assert not restarted(KvSignals(), KvSignals(requests_total=0))  # nothing to compare


def test_signals_survive_their_json_form() -> None:
    signals = parse_kv_signals(COLON_PAGE)
    assert KvSignals.from_json(signals.to_json()) == signals
    assert KvSignals.from_json({"num_running_reqs": 3, "from_a_newer_worker": 1}) == KvSignals(
        num_running_reqs=3
    )
