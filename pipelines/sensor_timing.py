"""Sensor intervals that give the tick cadence they say.

Dagster's sensor daemon looks at its sensors every 5 s
(`dagster._daemon.sensor.MIN_INTERVAL_LOOP_TIME`) and starts a tick when the
sensor's `minimum_interval_seconds` have passed since the previous tick
started. Ticks therefore land on that 5 s grid, and an interval that is a
multiple of it is a hair short at the look that should start the tick: a sweep
sensor with an interval of 10 s ticked every 15 s (measured through `dagster dev`:
14.9-15.1 s), the landing sensor's 60 s every 65 s. One second less lands on the
look meant: 9 s gave ticks 9.6-10.1 s apart.
"""

DAEMON_LOOK_SECONDS = 5  # Dagster's MIN_INTERVAL_LOOP_TIME; tests/pipelines/test_sensors.py checks it against Dagster's


def ticks_every(seconds: int) -> int:
    """The `minimum_interval_seconds` that makes a sensor tick every `seconds` (a multiple of the daemon's 5 s look).

    Raises:
        ValueError: `seconds` is not a positive multiple of 5 s, which no interval gives.
    """
    if seconds <= 0 or seconds % DAEMON_LOOK_SECONDS:
        raise ValueError(
            f"a sensor can tick every {seconds} s only if that is a positive multiple of the daemon's "
            f"{DAEMON_LOOK_SECONDS} s look"
        )
    return seconds - 1
