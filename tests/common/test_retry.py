import pytest

from common.retry import RetriesExhausted, retry_call


class FakeClock:
    def __init__(self):
        self.now = 0.0
        self.waits = []

    def sleep(self, s):
        self.waits.append(s)
        self.now += s

    def __call__(self):
        return self.now


def failing(times, error=ConnectionError):
    calls = []

    def fn():
        calls.append(1)
        if len(calls) <= times:
            raise error(f"failure {len(calls)}")
        return len(calls)

    return fn, calls


def test_retries_with_doubling_waits_then_succeeds():
    clock = FakeClock()
    fn, calls = failing(3)
    assert retry_call(fn, retry_on=ConnectionError, attempts=5, backoff_s=1, sleep=clock.sleep, clock=clock) == 4
    assert clock.waits == [1, 2, 4]


def test_gives_up_after_attempts_with_the_last_error_chained():
    clock = FakeClock()
    fn, calls = failing(10)
    with pytest.raises(RetriesExhausted, match="gave up after 3 attempt") as info:
        retry_call(
            fn, retry_on=ConnectionError, attempts=3, backoff_s=1, sleep=clock.sleep, clock=clock, describe="ping"
        )
    assert len(calls) == 3 and clock.waits == [1, 2]
    assert isinstance(info.value.__cause__, ConnectionError) and "failure 3" in str(info.value.__cause__)


def test_other_errors_propagate_unchanged_at_once():
    clock = FakeClock()
    fn, calls = failing(1, error=KeyError)
    with pytest.raises(KeyError):
        retry_call(fn, retry_on=ConnectionError, attempts=5, sleep=clock.sleep, clock=clock)
    assert len(calls) == 1 and clock.waits == []


def test_deadline_stops_before_a_wait_that_would_pass_it():
    clock = FakeClock()
    fn, calls = failing(100)
    with pytest.raises(RetriesExhausted):
        retry_call(
            fn,
            retry_on=ConnectionError,
            attempts=None,
            deadline_s=10,
            backoff_s=1,
            max_backoff_s=4,
            sleep=clock.sleep,
            clock=clock,
        )
    assert clock.waits == [1, 2, 4] and clock.now <= 10


def test_waits_are_capped_and_on_retry_sees_each():
    clock = FakeClock()
    seen = []
    fn, _ = failing(4)
    retry_call(fn, retry_on=ConnectionError, attempts=6, backoff_s=1, max_backoff_s=3, sleep=clock.sleep, clock=clock,
               on_retry=lambda n, e, w: seen.append((n, str(e), w)))
    assert clock.waits == [1, 2, 3, 3]
    assert seen[0] == (1, "failure 1", 1)


@pytest.mark.parametrize("kwargs, message", [
    ({"attempts": 0}, "attempts=0"),
    ({"attempts": None}, "deadline_s"),
    ({"backoff_s": 5, "max_backoff_s": 1}, "backoff_s=5"),
])
def test_bad_settings_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        retry_call(lambda: None, retry_on=ConnectionError, **kwargs)
