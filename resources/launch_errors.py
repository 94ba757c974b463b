"""What a failed launch means: the launch errors a retry policy reads, and how they are told from a launch's output.

`LocalLauncher` (and the Kubernetes launcher, from its pods' logs) map a launch
that produced no result to one of these errors with `outcome_error`: the ranks'
failure records first, then torchrun's failure summary (`parse_worker_exits`),
so the root cause is named first with its own rank's last log lines.
"""

from __future__ import annotations

import json
import re
import signal
from dataclasses import dataclass
from typing import Any, Optional

import fsspec

from training.spec import EXIT_BAD_CONFIG, EXIT_PREEMPTED, FAILURE_DIR, WATCHDOG_DIR


class LaunchError(Exception):
    """A training launch did not produce a result."""

    retryable = False

    def __init__(self, message: str, *, log_tail: str = "", rank: Optional[int] = None) -> None:
        super().__init__(message)
        self.log_tail = log_tail
        self.rank = rank


class TrainingConfigError(LaunchError):
    """The spec cannot work (unknown import path, rejected hyperparameters)."""


class TrainingCodeError(LaunchError):
    """Model or data code raised, or the loss diverged."""


class TrainingPreempted(LaunchError):
    """Stopped on request after checkpointing; resume by launching again."""

    retryable = True


class InfrastructureError(LaunchError):
    """Workers died without reporting a failure (killed, OOM, lost node), or a timeout."""

    retryable = True


def read_failures(output_uri: str) -> list[dict[str, Any]]:
    """The failure records the ranks wrote under `output_uri`, in rank file order."""
    fs, path = fsspec.core.url_to_fs("/".join([output_uri.rstrip("/"), FAILURE_DIR]))
    if not fs.exists(path):
        return []
    records = []
    for p in sorted(fs.glob(f"{path}/rank-*.json")):
        try:
            with fs.open(p, "r") as f:
                record = json.load(f)
        except (OSError, ValueError):
            # A rank stopped while writing its record (torchrun SIGTERMs the survivors of a dead
            # rank) leaves an empty or partial file: that rank recorded nothing (as `training.gang`).
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def read_watchdog_events(output_uri: str, since: float = 0.0) -> list[dict[str, Any]]:
    """The pod-side agents' reports under `output_uri` (hung ranks, stragglers and their clearing) written at or after
    `since` (epoch seconds), oldest first (docs/operations.md, "Hung and slow ranks")."""
    fs, path = fsspec.core.url_to_fs("/".join([output_uri.rstrip("/"), WATCHDOG_DIR]))
    if not fs.exists(path):
        return []
    events = []
    for p in fs.glob(f"{path}/*.json"):
        try:
            with fs.open(p, "r") as f:
                event = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(event, dict) and float(event.get("time", 0.0)) >= since:
            events.append(event)
    return sorted(events, key=lambda e: float(e.get("time", 0.0)))


def nodes_to_avoid(events: list[dict[str, Any]]) -> list[str]:
    """Nodes a later launch should avoid: where a rank hung, or a straggler was reported and never cleared."""
    avoid: dict[str, bool] = {}
    for e in sorted(events, key=lambda e: float(e.get("time", 0.0))):
        node = str(e.get("node"))
        if e.get("kind") in ("hang", "straggler"):
            avoid[node] = True
        elif e.get("kind") == "straggler_cleared" and not any(
            x.get("kind") == "hang" and x.get("node") == node for x in events
        ):
            avoid.pop(node, None)
    return sorted(avoid)


@dataclass(frozen=True)
class WorkerExit:
    """One failed worker in torchrun's failure summary (`ChildFailedError`)."""

    rank: int
    exitcode: int
    pid: int

    @property
    def signal_name(self) -> Optional[str]:
        """The signal that ended the worker (torchrun reports it as a negative exit code); None for a plain exit."""
        if self.exitcode >= 0:
            return None
        try:
            return signal.Signals(-self.exitcode).name
        except ValueError:
            return f"signal {-self.exitcode}"

    @property
    def stopped(self) -> bool:
        """Whether the worker ended on SIGTERM: killed by it (-15) or exiting 143 (128 + 15, `EXIT_PREEMPTED`).

        That is how torchrun stops the surviving workers of a group in which one
        died, and how a preemption ends a worker; it is never a cause of its own
        beside a worker that died otherwise (`outcome_error`).
        """
        return self.exitcode in (-signal.SIGTERM, 128 + signal.SIGTERM)

    def describe(self) -> str:
        if self.signal_name is None:
            return f"rank {self.rank} exited with status {self.exitcode} (pid {self.pid})"
        return f"rank {self.rank} was killed (signal {-self.exitcode}, {self.signal_name}; pid {self.pid})"


_SUMMARY_ENTRY = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*\d+\)\s*exitcode\s*:\s*(-?\d+)\s*\(pid:\s*(\d+)\)")


def parse_worker_exits(torchrun_output: str) -> list[WorkerExit]:
    """The failed workers named in the last failure summary torchrun printed, root cause first.

    torchrun ends a failed launch with a `ChildFailedError` block: "Failures:"
    (the other failed workers) and "Root Cause (first observed failure):", each
    entry naming `rank`, `exitcode` (negative: killed by that signal) and `pid`.
    An output without that block (a launch still running, a pod log) gives [].
    The root cause is only the first exit torchrun observed, to the second: a
    survivor it stopped can be named there too (`outcome_error` looks past it).
    """
    start = torchrun_output.rfind("Failures:")
    if start < 0:
        return []
    block = torchrun_output[start:]
    cause_at = block.find("Root Cause")
    if cause_at < 0:
        return []
    entries = list(_SUMMARY_ENTRY.finditer(block))
    root_cause = [m for m in entries if m.start() > cause_at]
    others = [m for m in entries if m.start() < cause_at]
    exits: dict[int, WorkerExit] = {}
    for m in root_cause + others:
        exits.setdefault(
            int(m.group(1)), WorkerExit(rank=int(m.group(1)), exitcode=int(m.group(2)), pid=int(m.group(3)))
        )
    return list(exits.values())


def _tail_text(lines: list[str], rank: Optional[int]) -> str:
    who = f"rank {rank}" if rank is not None else "the launch"
    return f"last {len(lines)} log lines of {who}:\n" + "\n".join(lines) if lines else f"(no log lines of {who})"


def _blamed_tail(rank_tails: dict[int, list[str]], log_tail: str, rank: Optional[int]) -> tuple[str, str]:
    """The log tail to keep with the error and the text to show: `rank`'s own last lines when known, else the
    launch's."""
    lines = rank_tails.get(rank, []) if rank is not None else []
    text = "\n".join(lines) if lines else log_tail
    return text, _tail_text(text.splitlines(), rank if lines else None)


def _silent_death(
    trial_id: str,
    silent: list[WorkerExit],
    failures: list[dict[str, Any]],
    stopped_untold: list[WorkerExit],
    tail: tuple[str, str],
) -> InfrastructureError:
    """Workers that died without a record (`silent`, the first is blamed): the root cause; the peers that recorded a
    failure, or were stopped by torchrun without one (`stopped_untold`), lost it. `tail`: the blamed rank's
    (`_blamed_tail`)."""
    culprit = silent[0].rank
    peers = [
        f"rank {f['rank']} then lost its peer ({f['error'][:200]})"
        for f in sorted(failures, key=lambda r: r.get("time", 0.0))
    ]
    peers += [
        f"rank {e.rank} then lost its peer (stopped by torchrun with SIGTERM after rank {culprit} died)"
        for e in stopped_untold
    ]
    deaths = "; ".join(e.describe() for e in silent)
    kept, shown = tail
    return InfrastructureError(
        f"trial {trial_id}: {deaths} without reporting an error (out of memory, a lost node or a kill from outside)"
        + "".join(f"; {p}" for p in peers) + f"\n{shown}",
        log_tail=kept, rank=culprit,
    )


def outcome_error(
    returncode: int,
    failures: list[dict[str, Any]],
    log_tail: str,
    trial_id: str,
    *,
    torchrun_output: Optional[str] = None,
    rank_tails: Optional[dict[int, list[str]]] = None,
) -> LaunchError:
    """Map a failed launch to the error a retry policy understands.

    The root cause comes first: a config or user failure record; a rank the
    pod-side agent found hung (its record names the rank, pod, node and stack); a preemption;
    then a worker that died without writing a record (named in torchrun's
    failure summary, e.g. SIGKILL by the kernel's OOM killer), whose peers'
    records ("lost a dependency") are consequences; then any other record.
    When the summary names a worker that ended otherwise than on SIGTERM,
    torchrun stopped the others after it died: a worker that ended on SIGTERM
    then (-15, or 143), with or without a record (even a preemption's), lost
    its peer and is never the cause, wherever the summary puts it.
    The first line of the message is a whole sentence (a Dagster log shows only
    it); the last log lines follow, of the blamed rank when `rank_tails` has them.

    Args:
        returncode: torchrun's exit status.
        failures: the ranks' failure records (`read_failures`).
        log_tail: the last lines of the whole launch's output.
        trial_id: named in the message.
        torchrun_output: where torchrun's failure summary is (default: `log_tail`).
        rank_tails: each rank's own last output lines, by rank, when known.
    """
    by_category: dict[str, dict[str, Any]] = {}
    for f in sorted(failures, key=lambda r: r.get("time", 0.0)):
        by_category.setdefault(f["category"], f)  # the first failure of each kind is the root cause
    rank_tails = rank_tails or {}

    def tail_of(rank: Optional[int]) -> tuple[str, str]:
        return _blamed_tail(rank_tails, log_tail, rank)

    if "config" in by_category:
        f = by_category["config"]
        return TrainingConfigError(
            f"trial {trial_id}: bad config (rank {f['rank']}): {f['error']}", log_tail=log_tail, rank=f["rank"]
        )
    if "user" in by_category:
        f = by_category["user"]
        return TrainingCodeError(
            f"trial {trial_id}: rank {f['rank']} raised {f['error']}\n{f['traceback']}",
            log_tail=log_tail,
            rank=f["rank"],
        )
    hangs = [f for f in failures if f.get("kind") == "hang"]
    if hangs:
        # The agent killed every worker of a hung gang (SIGKILL): their exits say nothing, the record names the rank.
        f = min(
            hangs, key=lambda r: (bool(r.get("consequence")), r.get("time", 0.0))
        )  # a pod whose ranks all waited comes last
        tail, shown = tail_of(f["rank"])
        return InfrastructureError(
            f"trial {trial_id}: {f['error']}\n{f.get('traceback', '')}\n{shown}", log_tail=tail, rank=f["rank"]
        )
    exits = parse_worker_exits(log_tail if torchrun_output is None else torchrun_output)
    # A worker that ended otherwise than on SIGTERM means torchrun stopped the others after it died:
    # their SIGTERM exits (and what they recorded while stopping, even a preemption checkpoint) are consequences.
    causes = [e for e in exits if not e.stopped]
    stopped = {e.rank for e in exits if e.stopped} if causes else set()
    preempted = [f for f in failures if f["category"] == "preempted" and f["rank"] not in stopped]
    if preempted or (returncode == EXIT_PREEMPTED and not causes):
        detail = min(preempted, key=lambda r: r.get("time", 0.0))["error"] if preempted else "SIGTERM"
        return TrainingPreempted(
            f"trial {trial_id}: preempted ({detail}); will resume from its last checkpoint", log_tail=log_tail
        )
    failures = [f for f in failures if f["category"] != "preempted"]
    recorded = {f["rank"] for f in failures}
    silent = [e for e in (causes or exits) if e.rank not in recorded]
    if silent:
        return _silent_death(
            trial_id,
            silent,
            failures,
            [e for e in exits if e.rank in stopped and e.rank not in recorded],
            tail_of(silent[0].rank),
        )
    if "infra" in by_category:
        f = by_category["infra"]
        tail, shown = tail_of(f["rank"])
        return InfrastructureError(
            f"trial {trial_id}: rank {f['rank']} lost a dependency: {f['error']}\n{shown}",
            log_tail=tail,
            rank=f["rank"],
        )
    return _exit_status_error(trial_id, returncode, log_tail)


def _exit_status_error(trial_id: str, returncode: int, log_tail: str) -> LaunchError:
    """A failed launch that neither a record nor torchrun's summary explains: its exit status says what it can."""
    if returncode == EXIT_BAD_CONFIG:
        # `training.gang` refused the command itself (its reason is in the tail): it cannot work.
        return TrainingConfigError(
            f"trial {trial_id}: the launch exited {returncode} (bad config)\n{_tail_text(log_tail.splitlines(), None)}",
            log_tail=log_tail,
        )
    return InfrastructureError(
        f"trial {trial_id}: workers exited with status {returncode} without reporting an error "
        f"(killed, out of memory or lost)\n{_tail_text(log_tail.splitlines(), None)}",
        log_tail=log_tail,
    )
