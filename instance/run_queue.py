"""The local run queue: Dagster's `QueuedRunCoordinator`, looked at twice as often as whole seconds allow.

Dagster's queue takes `dequeue_interval_seconds` in whole seconds, and its
daemon (`IntervalDaemon.core_loop`) waits out the interval in steps of 0.5 s
after each look. At 1 s (the least it takes), a queued run waited for the next
look 0.5 s on average and up to about 1.05 s, then its launch: with run
workers forked in ~0.3 s (`instance.run_launcher`), the queue was the larger
part of a short trial run's start (bench.sweep_throughput: queued 0.95-0.98 s,
launch 0.37-0.39 s per run at 68c476a).

`LocalRunQueue` is the same coordinator (the same submit, limits and daemon),
whose interval may be a fraction of a second, down to `MIN_INTERVAL_SECONDS`:
the daemon's own half-second wait step, so 0.5 looks about every 0.5 s plus the
look's own time. A look at an idle queue is a few small queries
(`deploy/local/dagster.yaml` says what it costs), which the local daemon,
whose connections are pooled (`instance.storage_connections`), pays twice a
second instead of once.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, Optional

from dagster import Field, Float, QueuedRunCoordinator
from dagster._serdes import ConfigurableClassData

log = logging.getLogger("trainyard.run_queue")

MIN_INTERVAL_SECONDS = 0.5  # IntervalDaemon.core_loop waits in steps of 0.5 s: a shorter interval looks no sooner


def _checked(seconds: Any) -> float:
    """`seconds` if it is a number of seconds the daemon can honour; else an error naming the setting."""
    if not isinstance(seconds, (int, float)) or isinstance(seconds, bool):
        raise TypeError(f"run queue: dequeue_interval_seconds must be a number of seconds, got {seconds!r}")
    if seconds < MIN_INTERVAL_SECONDS:
        raise ValueError(
            f"run queue: dequeue_interval_seconds {seconds} is below {MIN_INTERVAL_SECONDS}: Dagster's daemon waits "
            "in steps "
            f"of {MIN_INTERVAL_SECONDS} s between looks, so a shorter interval would not look sooner"
        )
    return float(seconds)


class RunQueue(QueuedRunCoordinator):
    """Dagster's `QueuedRunCoordinator`, which keeps the daemon's PostgreSQL connections and makes the instance's run
    launcher once, before its threads ask.

    The Kubernetes deployment's queue (`resources.k8s.helm`: the daemon and webserver run the orchestrator image, so
    this class is there); `LocalRunQueue` adds the fractional interval.
    """

    def register_instance(self, instance: Any) -> None:
        """Also pool the instance's PostgreSQL connections and make its run launcher now, when the daemon makes this
        queue (in its main thread, at its start).

        Every query of the daemon (a sensor's tick records, cursor and state, a schedule's, each look at the queue,
        run monitoring's) opened a PostgreSQL connection of its own: under the chart's instance, 20 pipelines' idle
        sensors made 62-64 sessions a second and cost the database 0.29-0.31 of a core, and the sweep sensors
        ticked late (docs/benchmarks.md, "The daemon's connections"). `hold_connections` pools them as the webserver
        pools its own, and leaves an instance pooled already alone (the webserver's; a code server's evaluations and
        a run worker's, which the platform pools); a short-lived process that submits a run (the CLI) holds one
        connection until it exits.

        The daemon's threads ask Dagster's lazy `instance.run_launcher`, which is not thread-safe: with
        `dequeue_use_threads`, runs dequeued together are launched from a pool of threads (run monitoring asks from
        its own). Threads that found none each made one, and one could launch through a launcher never registered
        to the instance ("Attempted to resolve undefined DagsterInstance weakref", CI at 629daac), or start warm
        run workers of its own (locally; `K8sRunLauncher`s of its own on Kubernetes)."""
        from instance.storage_connections import hold_connections

        super().register_instance(instance)
        hold_connections(instance)
        try:
            instance.run_launcher  # noqa: B018 - made here, once, before any thread asks
        except Exception as e:  # a process that never launches: Dagster's lazy path reports it if one does
            # Every process that loads the instance makes its queue (the webserver to submit, a code server to
            # evaluate a sensor); a Kubernetes code server has no API credentials, so `K8sRunLauncher` cannot be made
            # there, and it never launches. Making it there was never needed: it is needed in the daemon.
            log.debug(
                "run queue: the run launcher was not made ahead (%s: %s); it is made when first used",
                type(e).__name__,
                e,
            )


class LocalRunQueue(RunQueue):
    """`RunQueue` whose `dequeue_interval_seconds` may be fractional (>= `MIN_INTERVAL_SECONDS`)."""

    def __init__(self, dequeue_interval_seconds: Optional[float] = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if dequeue_interval_seconds is not None:
            self._dequeue_interval_seconds = _checked(dequeue_interval_seconds)  # type: ignore[assignment]

    @property
    def dequeue_interval_seconds(self) -> float:  # type: ignore[override]
        return self._dequeue_interval_seconds

    @classmethod
    def config_type(cls) -> Any:
        schema = dict(super().config_type())  # type: ignore[arg-type]
        schema["dequeue_interval_seconds"] = Field(
            Float,
            is_required=False,
            description=f"Seconds between the daemon's looks at the queue (>= {MIN_INTERVAL_SECONDS}; Dagster's own "
                        "queue takes whole "
            "seconds only).",
        )
        return schema

    @classmethod
    def from_config_value(cls, inst_data: ConfigurableClassData, config_value: Mapping[str, Any]) -> "LocalRunQueue":
        """Dagster's own reading of every other setting (its `from_config_value` makes `cls`), then the interval as
        given."""
        queue = super().from_config_value(
            inst_data, {k: v for k, v in config_value.items() if k != "dequeue_interval_seconds"}
        )
        if config_value.get("dequeue_interval_seconds") is not None:
            queue._dequeue_interval_seconds = _checked(config_value["dequeue_interval_seconds"])  # type: ignore[assignment]
        return queue
