"""The one backoff rule: doubling from the first wait up to the cap, from the start after a success."""

from __future__ import annotations

import pytest

from datagen.backoff import Backoff


def test_waits_double_up_to_the_cap_and_start_over_after_a_success() -> None:
    backoff = Backoff(0.5, 5.0)
    assert [backoff.next_s() for _ in range(6)] == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0]
    assert backoff.failures == 6
    backoff.reset()
    assert (backoff.failures, backoff.next_s()) == (0, 0.5)


def test_a_first_wait_at_the_cap_stays_there() -> None:
    backoff = Backoff(30.0, 30.0)
    assert [backoff.next_s() for _ in range(3)] == [30.0, 30.0, 30.0]


@pytest.mark.parametrize(("first_s", "max_s"), [(0.0, 1.0), (2.0, 1.0), (-1.0, 5.0)])
def test_a_backoff_that_would_not_wait_or_shrink_is_refused(first_s: float, max_s: float) -> None:
    with pytest.raises(ValueError, match="0 < first_s <= max_s"):
        Backoff(first_s, max_s)
