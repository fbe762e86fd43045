"""producer.retry: how long a device waits before sending a 429 or 503 again, and which refusals
it sends again at all."""

from __future__ import annotations

import random

import pytest

from producer.retry import DEVICE_RETRY, RETRYABLE_STATUSES, RetryPolicy, parse_retry_after


class FixedDraw(random.Random):
    """A generator whose every draw is ``value``: the jitter factor becomes 1 + jitter·value."""

    def __init__(self, value: float) -> None:
        super().__init__()
        self.value = value

    def random(self) -> float:
        return self.value


def test_the_wait_is_the_servers_retry_after_not_the_backoff():
    policy = RetryPolicy(backoff_s=0.01, max_wait_s=60.0, jitter=0.5)
    # The lower bound: a device never comes back before the gateway said it may.
    assert policy.wait_s(1, 3.0, FixedDraw(0.0)) == 3.0
    assert policy.wait_s(5, 3.0, FixedDraw(0.0)) == 3.0, "Retry-After, whatever the try"
    assert policy.wait_s(1, 3.0, FixedDraw(1.0)) == 4.5, "stretched by at most the jitter"
    assert policy.wait_s(1, 0.0, FixedDraw(0.7)) == 0.0, "Retry-After: 0 means at once"


def test_without_retry_after_the_wait_doubles_from_the_backoff():
    policy = RetryPolicy(backoff_s=0.25, max_wait_s=60.0, jitter=0.5)
    assert [policy.wait_s(k, None, FixedDraw(0.0)) for k in (1, 2, 3, 4)] == [0.25, 0.5, 1.0, 2.0]
    assert policy.wait_s(2, None, FixedDraw(0.5)) == 0.5 * 1.25


def test_the_wait_is_capped_at_max_wait_before_the_jitter():
    policy = RetryPolicy(backoff_s=1.0, max_wait_s=5.0, jitter=0.5)
    assert policy.wait_s(1, 120.0, FixedDraw(0.0)) == 5.0
    assert policy.wait_s(1, 120.0, FixedDraw(1.0)) == 7.5
    assert policy.wait_s(10, None, FixedDraw(0.0)) == 5.0
    assert policy.wait_s(1, 5.0, FixedDraw(0.0)) == 5.0, "a wait at the cap is kept"


def test_the_jitter_is_drawn_from_the_given_generator():
    policy = RetryPolicy(backoff_s=1.0, max_wait_s=60.0, jitter=0.5)
    expected = 2.0 * (1.0 + 0.5 * random.Random(11).random())
    assert policy.wait_s(1, 2.0, random.Random(11)) == expected
    waits = {policy.wait_s(1, 2.0) for _ in range(50)}
    assert all(2.0 <= w <= 3.0 for w in waits) and len(waits) > 1, "the module's generator"


def test_only_429_and_503_are_sent_again():
    assert RETRYABLE_STATUSES == {429, 503}


def test_the_device_policy_tries_eight_times_from_half_a_second_up_to_a_minute():
    assert (DEVICE_RETRY.max_attempts, DEVICE_RETRY.backoff_s, DEVICE_RETRY.max_wait_s,
            DEVICE_RETRY.jitter) == (8, 0.5, 60.0, 0.5)


@pytest.mark.parametrize(("header", "seconds"), [
    ("2", 2.0), (" 1.5 ", 1.5), ("0", 0.0), (None, None), ("", None), ("soon", None),
    ("-1", None), ("Wed, 21 Oct 2015 07:28:00 GMT", None),
])
def test_retry_after_is_read_in_its_delta_seconds_form_only(header, seconds):
    assert parse_retry_after(header) == seconds


@pytest.mark.parametrize(("fields", "message"), [
    ({"max_attempts": 0}, "max_attempts must be ≥ 1, got 0"),
    ({"backoff_s": 0.0}, "backoff_s and max_wait_s must be > 0, jitter ≥ 0"),
    ({"max_wait_s": 0.0}, "backoff_s and max_wait_s must be > 0, jitter ≥ 0"),
    ({"jitter": -0.1}, "backoff_s and max_wait_s must be > 0, jitter ≥ 0"),
])
def test_a_policy_that_could_not_retry_sensibly_is_refused_with_what_is_wrong(fields, message):
    with pytest.raises(ValueError) as refused:
        RetryPolicy(**fields)
    assert str(refused.value) == message


def test_a_policy_of_one_try_no_jitter_and_sub_second_waits_is_allowed():
    policy = RetryPolicy(max_attempts=1, backoff_s=0.1, max_wait_s=0.5, jitter=0.0)
    assert policy.wait_s(1, 2.0) == 0.5
