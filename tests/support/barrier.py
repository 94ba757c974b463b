"""A file-based barrier for trials running in separate processes, which also counts who was inside at once.

Each trial enters (`inside/<name>` appears), notes how many trials are inside at that
moment, waits until `parties` trials have been inside together (the barrier then stays
open), and leaves when done (its file goes). Concurrency only rises when someone enters,
and the entrant counts itself and everyone still inside, so the largest count noted at
an entry is the most trials that ran at once (never more; less only if a trial left in
the instant between an entrant's file appearing and its look). "Two at once" is
guaranteed by the wait, and "never three" is read from `peak()`, not from timestamps.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Callable, Iterator


class BarrierTimeout(TimeoutError):
    """The barrier did not fill within its timeout."""


class FileBarrier:
    """A barrier over a directory that several processes share.

    Args:
        directory: Shared directory (created on first use).
        parties: How many trials must be inside together to open the barrier.
        timeout: Seconds an entrant waits for the barrier to open.
        clock: Monotonic clock; `sleep`: how to wait between looks (both injectable).
    """

    def __init__(self, directory: Path, parties: int, timeout: float = 120.0,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
        if parties < 1:
            raise ValueError(f"parties={parties}: a barrier needs at least 1 party")
        self.directory = Path(directory)
        self.parties = parties
        self.timeout = timeout
        self.clock = clock
        self.sleep = sleep

    @property
    def _inside(self) -> Path:
        return self.directory / "inside"

    @property
    def _seen(self) -> Path:
        return self.directory / "seen"

    @property
    def _open(self) -> Path:
        return self.directory / "open"

    def inside_now(self) -> list[str]:
        """Names of the trials inside right now."""
        return sorted(p.name for p in self._inside.iterdir()) if self._inside.exists() else []

    def is_open(self) -> bool:
        """Whether `parties` trials have been inside together."""
        return self._open.exists()

    def peak(self) -> int:
        """The most trials inside at once so far (0 before anyone entered)."""
        if not self._seen.exists():
            return 0
        return max((int(p.read_text()) for p in self._seen.iterdir()), default=0)

    @contextlib.contextmanager
    def inside(self, name: str) -> Iterator[int]:
        """Enter as `name`, wait for the barrier to open, and leave on exit; yields how many were inside on entry.

        Raises:
            BarrierTimeout: Fewer than `parties` trials came inside within `timeout`.
        """
        self._inside.mkdir(parents=True, exist_ok=True)
        self._seen.mkdir(parents=True, exist_ok=True)
        (self._inside / name).touch()
        try:
            count = len(self.inside_now())
            (self._seen / name).write_text(str(count))
            self._wait_open(name)
            yield count
        finally:
            (self._inside / name).unlink()

    def _wait_open(self, name: str) -> None:
        deadline = self.clock() + self.timeout
        while not self.is_open():
            if len(self.inside_now()) >= self.parties:
                self._open.touch()
                return
            if self.clock() > deadline:
                raise BarrierTimeout(
                    f"{name}: barrier {self.directory} waited {self.timeout:g} s for {self.parties} trials at once; "
                    f"inside: {self.inside_now()}"
                )
            self.sleep(0.05)
