"""The KV controller's decisions and its reading of SGLang's /metrics, in both name forms."""

from __future__ import annotations

from workers.controller import KvSignals, decide, parse_kv_signals

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
"""


def test_parse_colon_form_sums_dp_ranks_and_takes_the_fullest_pool() -> None:
    signals = parse_kv_signals(COLON_PAGE)
    assert signals == KvSignals(
        token_usage=0.95,
        num_queue_reqs=12,
        num_running_reqs=190,
        retracted_total=4,
        max_total_num_tokens=200000,
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


def test_a_server_queue_snaps_the_target_to_what_runs() -> None:
    signals = KvSignals(token_usage=0.97, num_queue_reqs=300, num_running_reqs=180)
    decision = decide(512, None, signals, floor=10, ceiling=512)
    assert decision.target == 189  # 180 running + a tolerance of 5 % (9)
    assert decision.reason is not None and "300 requests waiting" in decision.reason
    # Already at what runs: a further 10 % down.
    assert decide(189, None, signals, floor=10, ceiling=512).target == 170


def test_headroom_grows_only_when_the_target_is_in_use() -> None:
    busy = KvSignals(token_usage=0.5, num_queue_reqs=0, num_running_reqs=95)
    assert decide(100, None, busy, floor=1, ceiling=512).target == 110
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
