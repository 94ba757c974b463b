"""The one program every training process runs: `python -m training.entrypoint --spec URI`.

Launched by torchrun (one process per device) on this machine or in a pod. It
reads the `TrainSpec` and runs its task (`training.lightning_task` or
`training.gbt`), which trains, evaluates the best weights on the full validation
and test splits and exports a serving model; then it writes `result.json` last,
so a present `result.json` means the trial finished.

Failures are written to `<output>/failures/rank-<r>.json` with the rank's
traceback and the process exits with a status from `training.spec`:
`EXIT_BAD_CONFIG` when the spec cannot work, `EXIT_USER_ERROR` when model or
data code raised. torchrun does not pass these on (it exits 1); `training.gang`,
which runs torchrun, reads the records and exits with the first failing rank's.
Under `training.gang` a signal (`training.watchdog.STACK_SIGNAL`) dumps every
thread's stack for the agent's hang watchdog.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import traceback
from typing import Any, Optional

import fsspec

from common.settings import settings
from training.errors import ConfigError, Preempted
from training.spec import (
    EXIT_BAD_CONFIG,
    EXIT_INFRA,
    EXIT_PREEMPTED,
    EXIT_USER_ERROR,
    FAILURE_DIR,
    RESULT_FILE,
    TrainResult,
    TrainSpec,
)
from training.storage import join, write_atomic
from training.watchdog import arm_stack_dump

log = logging.getLogger("trainyard.training")


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def load_spec(uri: str) -> TrainSpec:
    try:
        with fsspec.open(uri, "r") as f:
            return TrainSpec.from_json(f.read())
    except FileNotFoundError as e:
        raise ConfigError(f"spec file {uri!r} does not exist") from e
    except ValueError as e:
        raise ConfigError(f"spec file {uri!r} is invalid: {e}") from e


def train(spec: TrainSpec) -> Optional[TrainResult]:
    """Run the trial's task; returns the result on rank 0 and None elsewhere.

    The task's module is imported here, not at the top: a GBT trial never loads
    torch or Lightning, and a Lightning trial never loads LightGBM beside torch.
    """
    from training.threads import apply_thread_counts

    if spec.task == "gbt":
        from training.gbt import run_gbt

        apply_thread_counts()  # the rank's CPU share, on a forked warm worker as in a fresh process
        return run_gbt(spec)
    from training.lightning_task import run_lightning

    apply_thread_counts()
    return run_lightning(spec, _rank())


def classify_failure(exc: BaseException) -> tuple[str, bool]:
    """(category, consequence): config | user | preempted | infra, and whether `exc` only echoes another failure.

    A consequence is how this rank saw a failure elsewhere: it lost a peer, or
    was told to stop while blocked in a collective. `training.gang` looks past
    such records for the rank that failed first.
    """
    # The SIGTERM flag lives in training.fault_tolerance; not imported (GBT, early failures) means never set.
    fault_tolerance = sys.modules.get("training.fault_tolerance")
    # The checkpoint store loads torch, which a GBT trial that failed never needs.
    from training.checkpointing import CheckpointError
    from training.distributed import lost_peer

    if isinstance(exc, ConfigError):
        return "config", False
    if isinstance(exc, Preempted):
        return "preempted", False
    if isinstance(exc, CheckpointError):
        return "infra", False
    # A rank that lost a peer, or was told to stop while blocked in a collective, is an infrastructure casualty.
    if lost_peer(exc) or (fault_tolerance is not None and fault_tolerance.SIGTERM_RECEIVED):
        return "infra", True
    return "user", False


def failure_category(exc: BaseException) -> str:
    """config | user | preempted | infra: what the launcher maps to terminal or retryable."""
    return classify_failure(exc)[0]


EXIT_CODES = {"config": EXIT_BAD_CONFIG, "user": EXIT_USER_ERROR, "preempted": EXIT_PREEMPTED, "infra": EXIT_INFRA}


def earlier_terminal_failure(output_uri: str) -> Optional[dict[str, Any]]:
    """A config or user failure recorded by an earlier worker group of this same launch.

    torchrun restarts the worker group after any failure; a bug in model code
    would fail the same way again, so a restarted group stops at once instead.
    """
    launch = settings().launch_id
    if launch is None or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        return None
    fs, path = fsspec.core.url_to_fs(join(output_uri, FAILURE_DIR))
    if not fs.exists(path):
        return None
    for p in sorted(fs.glob(f"{path}/rank-*.json")):
        try:
            with fs.open(p, "r") as f:
                record = json.load(f)
        except (OSError, ValueError):
            # Cut short (a rank stopped while writing it, before records were written atomically): that rank
            # recorded nothing, as `training.gang` and the launcher read it; never a reason to fail this group.
            continue
        if isinstance(record, dict) and record.get("launch") == launch and record.get("category") in ("config", "user"):
            return record
    return None


def write_failure(
    spec_uri: str, output_uri: Optional[str], category: str, exc: BaseException, *, consequence: bool = False
) -> None:
    record = {
        "rank": _rank(),
        "launch": settings().launch_id,
        "time": time.time(),
        "category": category,
        "consequence": consequence,
        "error": f"{type(exc).__name__}: {exc}",
        "traceback": "".join(traceback.format_exception(exc)),
        "spec": spec_uri,
    }
    if output_uri is None:
        output_uri = spec_uri.rsplit("/", 1)[0]
    # Atomic: the agent stops the survivors of a failed rank with SIGTERM, often while they write this record.
    write_atomic(
        join(output_uri, FAILURE_DIR, f"rank-{record['rank']}.json"), json.dumps(record, indent=2).encode(), fsync=False
    )


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.entrypoint", description=__doc__.splitlines()[0])
    parser.add_argument("--spec", required=True, help="URI of the TrainSpec JSON")
    args = parser.parse_args(argv)
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(f"[rank {_rank()}] %(asctime)s %(levelname)s: %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    # Under training.gang: SIGUSR1 dumps this process's stacks where the agent reads them when it finds a rank hung.
    arm_stack_dump()
    spec: Optional[TrainSpec] = None
    try:
        spec = load_spec(args.spec)
        earlier = earlier_terminal_failure(spec.output_uri)
        if earlier is not None:
            log.error(
                "an earlier worker group of this launch failed on rank %s (%s); not training again",
                earlier["rank"],
                earlier["error"],
            )
            return EXIT_CODES[earlier["category"]]
        result = train(spec)
    except Exception as e:
        category, consequence = classify_failure(e)
        write_failure(args.spec, spec.output_uri if spec else None, category, e, consequence=consequence)
        if category == "config":
            log.error("bad config: %s", e)
        elif category == "preempted":
            log.warning("preempted: %s", e)
        else:
            traceback.print_exc()
        return EXIT_CODES[category]
    if result is not None:
        with fsspec.open(join(spec.output_uri, RESULT_FILE), "w", auto_mkdir=True) as f:
            f.write(result.model_dump_json(indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
