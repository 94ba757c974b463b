"""The pod's fault-tolerance settings a `TrainSpec` carries: checkpointing, the hang and straggler watchdog, drills.

Part of the contract (`training.spec` re-exports every name here; import them
from there): `CheckpointPolicy` (when and how the pod checkpoints, with its
`WatchdogPolicy`) and `FaultInjection` (test-only faults and drills). Plain
pydantic over the standard library, like the rest of the spec.
"""

from __future__ import annotations

from typing import Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator


class StrictModel(BaseModel):
    """The base of every spec model (`training.spec`'s too): unknown fields refused, frozen."""

    # A validation error never echoes its input: a credential put where it must not be stays unshown.
    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)


# Seconds the agent may take from declaring a hang to the workers' kill (stack dumps, records): the
# collective timeout must leave them on top of the longest hang timeout (`WatchdogPolicy`).
HANG_ACTION_SECONDS = 60.0


class WatchdogPolicy(StrictModel):
    """When the pod-side agent (`training.gang`) declares a rank hung or a straggler (docs/operations.md, "Hung and slow
    ranks").

    A rank that made no progress (a training or validation batch) for
    max(`hang_floor_seconds`, `hang_step_multiple` x its recent mean step time)
    is hung; the timeout never exceeds `collective_timeout_seconds` -
    `HANG_ACTION_SECONDS`. Before a rank's first step (start-up, loading a
    checkpoint, a first compile) only `hang_startup_seconds` bounds it; None
    (the default): nothing does but the collective timeout, since start-up time
    has no step time to scale with. A rank whose data and forward time over the
    last `straggler_window_steps` steps exceeds `straggler_factor` x the median
    of the other ranks' (and the difference is at least 5% of a step) is a straggler.

    The rule: `collective_timeout_seconds` (the process group's timeout, gloo
    and NCCL) must exceed the hang timeout plus `HANG_ACTION_SECONDS`.
    Otherwise a collective that waits on the hung rank fails first, every rank
    records only that it lost a peer, and nothing names the hung one.
    """

    enabled: bool = True
    hang_floor_seconds: float = Field(300.0, gt=0, description="the shortest hang timeout, whatever the step time")
    hang_step_multiple: float = Field(
        20.0, ge=1, description="the hang timeout in mean step times, when above the floor"
    )
    hang_startup_seconds: Optional[float] = Field(None, gt=0, description="bound before the first step (None: none)")
    collective_timeout_seconds: float = Field(1800.0, gt=0, description="the process group's collective timeout")
    straggler_factor: float = Field(1.5, gt=1, description="how much slower than the others' median a straggler is")
    straggler_window_steps: int = Field(20, ge=2, description="steps a straggler's mean is taken over")

    @model_validator(mode="after")
    def _collectives_outlast_hangs(self) -> "WatchdogPolicy":
        if self.collective_timeout_seconds < self.hang_floor_seconds + HANG_ACTION_SECONDS:
            raise ValueError(
                f"collective_timeout_seconds={self.collective_timeout_seconds:g} must be at least hang_floor_seconds "
                f"({self.hang_floor_seconds:g}) + {HANG_ACTION_SECONDS:g} s: a collective that times out before the "
                "hang "
                "timeout leaves every rank recording a lost peer and nothing naming the hung rank"
            )
        return self

    def hang_timeout(self, mean_step_seconds: Optional[float]) -> Optional[float]:
        """Seconds without progress after which a rank is hung; `mean_step_seconds` None: before its first step.

        Example:
            >>> policy = WatchdogPolicy()
            >>> policy.hang_timeout(0.5), policy.hang_timeout(30.0), policy.hang_timeout(None)
            (300.0, 600.0, None)
        """
        if mean_step_seconds is None:
            return self.hang_startup_seconds
        cap = self.collective_timeout_seconds - HANG_ACTION_SECONDS
        return min(cap, max(self.hang_floor_seconds, self.hang_step_multiple * mean_step_seconds))


class CheckpointPolicy(StrictModel):
    """When and how the pod checkpoints.

    With neither `every_n_steps` nor `every_seconds` set, the interval is the
    Young/Daly optimum sqrt(2 x save time x job MTBF) from the measured time of
    the first save, with job MTBF = `node_mtbf_hours` / nodes.
    """

    every_n_steps: Optional[int] = Field(None, ge=1)
    every_seconds: Optional[float] = Field(None, gt=0)
    node_mtbf_hours: float = Field(5000.0, gt=0)
    keep_last: int = Field(3, ge=1)
    async_save: bool = True
    preemption_deadline_seconds: float = Field(60.0, gt=0)
    write_attempts: int = Field(3, ge=1)
    watchdog: WatchdogPolicy = Field(default_factory=WatchdogPolicy, description="when a rank is hung or a straggler")


class FaultInjection(StrictModel):
    """Test-only faults and pre-flight drills; never set in production pipelines.

    Each fault fires once per trial (a marker under the trial directory records
    it), so the resumed attempt runs clean.
    """

    raise_at_step: Optional[int] = Field(None, ge=0, description="raise in training on every rank at this step")
    kill_rank: Optional[int] = Field(None, ge=0, description="SIGKILL this rank at kill_at_step")
    kill_at_step: Optional[int] = Field(None, ge=1)
    sigterm_at_step: Optional[int] = Field(
        None, ge=1, description="SIGTERM the launcher agent (a preemption) at this step"
    )
    corrupt_latest_checkpoint: bool = Field(False, description="corrupt the newest checkpoint before resuming")
    fail_storage_writes: int = Field(0, ge=0, description="the next n checkpoint writes fail transiently")
    nan_at_step: Optional[int] = Field(None, ge=1, description="make the loss NaN at this step")
    hang_rank: Optional[int] = Field(
        None, ge=0, description="this rank blocks forever before hang_at_step's gradient all-reduce"
    )
    hang_at_step: Optional[int] = Field(None, ge=1)
    slow_rank: Optional[int] = Field(
        None, ge=0, description="this rank sleeps slow_seconds in every step (a straggler)"
    )
    slow_seconds: float = Field(0.0, ge=0)

    @model_validator(mode="after")
    def _kill_pair(self) -> "FaultInjection":
        if (self.kill_rank is None) != (self.kill_at_step is None):
            raise ValueError("kill_rank and kill_at_step are set together")
        if (self.hang_rank is None) != (self.hang_at_step is None):
            raise ValueError("hang_rank and hang_at_step are set together")
        if (self.slow_rank is None) != (self.slow_seconds == 0):
            raise ValueError(
                f"slow_rank and slow_seconds (> 0) are set together, got slow_rank={self.slow_rank}, "
                f"slow_seconds={self.slow_seconds}"
            )
        return self
