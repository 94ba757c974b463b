"""Data versioning with DVC: pin a file's exact bytes to a remote, restore them anywhere.

`DataVersioning.pin` tracks a file with `dvc add` in a working DVC repository
and pushes it to the remote; the returned `Pin` carries the text of the
`.dvc` file, which is all anyone needs to get the same bytes back:
`DataVersioning.restore` (or `dvc pull` by hand) in any fresh directory
configured with the same remote. The pin's md5 is the one DVC wrote into that
file, so it is the data version Dagster records.

DVC runs in a subprocess: its output is captured for error messages, every
call has a deadline, and its import cost and global state (logging, locks) stay
out of the orchestrator process. The commands of one `pin` or `restore` (init
and remote configuration when needed, then add and push, or pull) run one after
another in one interpreter through DVC's own command-line entry point
(`dvc.cli.main`), stopping at the first that fails: DVC takes seconds to import,
and a process per command paid that three to five times per pin.

Example:
    >>> dv = DataVersioning(repo_dir="/tmp/dvc-work", remote_url="/tmp/dvc-remote")
    >>> pin = dv.pin("/tmp/data.parquet")  # doctest: +SKIP
    >>> dv.restore(pin.dvc_file, pin.path, "/tmp/restore")  # doctest: +SKIP
    '/tmp/restore/snapshots/data.parquet'
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from typing import Optional

from dagster import ConfigurableResource
from pydantic import PrivateAttr

from common.atomic import exclusive_lock
from trainyard.store import no_space

_REMOTE = "trainyard"
_SNAPSHOTS = "snapshots"
_MARK = "\x1etrainyard-dvc-command "
# One interpreter for a batch of DVC commands (a JSON list of argument lists in argv[1]):
# each is announced on stderr (so a failure or a deadline names its command), then run by
# DVC's own entry point; the first non-zero exit status ends the batch with that status.
_BATCH = f"""
import json, sys
from dvc.cli import main
for number, args in enumerate(json.loads(sys.argv[1])):
    print({_MARK!r} + str(number), file=sys.stderr, flush=True)
    code = main(args)
    if code:
        sys.stdout.flush()
        sys.exit(code)
"""


class DataVersioningError(Exception):
    """A DVC command failed or produced something unexpected; the message carries its output."""


@dataclasses.dataclass(frozen=True)
class Pin:
    """A file pinned by DVC.

    Attributes:
        md5: The md5 DVC recorded for the file (hex).
        size: Size in bytes DVC recorded.
        dvc_file: Full text of the `.dvc` file; with the remote, enough to restore the bytes.
        path: Path of the tracked file relative to the repository root, e.g.
            `snapshots/data.parquet`; the `.dvc` file lives at `<path>.dvc`.
    """

    md5: str
    size: int
    dvc_file: str
    path: str


def parse_dvc_file(text: str) -> tuple[str, int, str]:
    """The (md5, size, path) of the single output recorded in a `.dvc` file.

    Raises:
        DataVersioningError: The text is not a `.dvc` file with exactly one
            file output carrying an md5.
    """
    import yaml

    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise DataVersioningError(f"not a valid .dvc file ({e}):\n{text}") from e
    outs = doc.get("outs") if isinstance(doc, dict) else None
    if not isinstance(outs, list) or len(outs) != 1 or not isinstance(outs[0], dict):
        raise DataVersioningError(f".dvc file must record exactly one output under 'outs', got:\n{text}")
    out = outs[0]
    md5, size, path = out.get("md5"), out.get("size"), out.get("path")
    if not isinstance(md5, str) or not isinstance(size, int) or not isinstance(path, str):
        raise DataVersioningError(f".dvc file output needs md5, size and path, got {out!r}")
    if md5.endswith(".dir"):
        raise DataVersioningError(f".dvc file tracks a directory ({md5}); only single files are pinned")
    return md5, size, path


class DataVersioning(ConfigurableResource):
    """A DVC working repository (no git) and the remote its pins are pushed to.

    Attributes:
        repo_dir: Local working directory of the DVC repository; initialised
            with `dvc init --no-scm` on first use. One per machine is enough;
            pins in it are serialised by a file lock.
        remote_url: Where pinned data is pushed: a local directory or
            `s3://bucket/prefix` (S3 needs the `dvc-s3` plugin installed).
        remote_endpoint_url: S3-compatible endpoint for the remote (MinIO,
            moto); None for AWS. Credentials come from the AWS environment.
        command_timeout_s: Deadline of each DVC command.
    """

    repo_dir: str
    remote_url: str
    remote_endpoint_url: Optional[str] = None
    command_timeout_s: float = 900.0

    _configured: set[str] = PrivateAttr(default_factory=set)

    def pin(self, local_file: str) -> Pin:
        """Track `local_file` with DVC and push it to the remote.

        A file already inside `repo_dir` is tracked where it is. Any other
        file is first copied to `snapshots/<file name>` in `repo_dir`
        (replacing the previous snapshot of that name: the bytes of every
        pin stay in the DVC cache and the remote, and the returned `.dvc`
        text is what refers to them). Pinning identical bytes again gives
        the same md5.

        Args:
            local_file: Path of the file to pin.

        Returns:
            The pin, with the md5 and size read back from the `.dvc` file DVC wrote.

        Raises:
            DataVersioningError: The file is missing or a DVC command failed.
        """
        source = os.path.abspath(local_file)
        if not os.path.isfile(source):
            raise DataVersioningError(f"cannot pin {local_file!r}: no such file")
        repo = os.path.abspath(self.repo_dir)
        os.makedirs(repo, exist_ok=True)
        with exclusive_lock(os.path.join(repo, ".trainyard-dvc.lock")):
            setup = self._repo_setup(repo)
            if os.path.commonpath([source, repo]) == repo:
                rel = os.path.relpath(source, repo)
            else:
                rel = os.path.join(_SNAPSHOTS, os.path.basename(source))
                target = os.path.join(repo, rel)
                os.makedirs(os.path.dirname(target), exist_ok=True)
                tmp = f"{target}.tmp-{os.getpid()}"
                shutil.copyfile(source, tmp)
                os.replace(tmp, target)
            # Not --quiet: DVC then hides its own error ("ERROR: ... No space left on device"), leaving only the exit
            # code.
            self._dvc(repo, *setup, ("add", rel), ("push", "--remote", _REMOTE, f"{rel}.dvc"))
            self._configured.add(repo)
            dvc_path = os.path.join(repo, f"{rel}.dvc")
            with open(dvc_path, encoding="utf-8") as f:
                text = f.read()
            md5, size, _ = parse_dvc_file(text)
        return Pin(md5=md5, size=size, dvc_file=text, path=rel.replace(os.sep, "/"))

    def restore(self, dvc_file_text: str, rel_path: str, dest_dir: str) -> str:
        """Get the exact bytes of a pin back into a fresh directory.

        `dest_dir` becomes a DVC repository of its own (never `repo_dir`)
        configured with this resource's remote; the `.dvc` text is written to
        `<dest_dir>/<rel_path>.dvc` and `dvc pull` fetches the data.

        Args:
            dvc_file_text: `Pin.dvc_file`.
            rel_path: `Pin.path`, where the file lands under `dest_dir`.
            dest_dir: Directory to restore into; created if absent.

        Returns:
            Absolute path of the restored file.

        Raises:
            DataVersioningError: `rel_path` leaves `dest_dir`, `dest_dir` is
                `repo_dir`, the pin is not in the remote, or DVC failed.
        """
        dest = os.path.abspath(dest_dir)
        if dest == os.path.abspath(self.repo_dir):
            raise DataVersioningError(f"dest_dir {dest_dir!r} is the working repo_dir; restore into a fresh directory")
        target = os.path.abspath(os.path.join(dest, rel_path))
        if os.path.isabs(rel_path) or os.path.commonpath([target, dest]) != dest:
            raise DataVersioningError(f"rel_path {rel_path!r} must be a relative path inside dest_dir {dest_dir!r}")
        md5, _, recorded = parse_dvc_file(dvc_file_text)
        if recorded != os.path.basename(rel_path):
            raise DataVersioningError(
                f"rel_path {rel_path!r} does not end with the file the .dvc text records ({recorded!r})"
            )
        os.makedirs(os.path.dirname(target), exist_ok=True)
        setup = self._repo_setup(dest)
        with open(f"{target}.dvc", "w", encoding="utf-8") as f:
            f.write(dvc_file_text)
        self._dvc(dest, *setup, ("pull", "--force", "--remote", _REMOTE, f"{rel_path}.dvc"))
        self._configured.add(dest)
        if not os.path.isfile(target):
            raise DataVersioningError(f"dvc pull of {md5} reported success but {target} does not exist")
        return target

    def _repo_setup(self, repo: str) -> list[tuple[str, ...]]:
        """The DVC commands that initialise `repo` if needed and point its default remote at `remote_url`.

        The remote is (re)configured once per resource instance and directory
        (the caller marks the directory configured once its batch succeeded):
        `remote add --force` replaces the whole section, so a changed URL or a
        removed endpoint never lingers from an earlier configuration.
        """
        if self.remote_url.startswith("s3://") and importlib.util.find_spec("dvc_s3") is None:
            raise DataVersioningError(
                f"remote_url {self.remote_url!r} needs the dvc-s3 plugin, which is not installed; "
                "install dvc[s3] or use a local directory remote"
            )
        commands: list[tuple[str, ...]] = []
        if not os.path.isdir(os.path.join(repo, ".dvc")):
            commands.append(("init", "--no-scm", "--quiet"))
            self._configured.discard(repo)
        if repo in self._configured:
            return commands
        url = self.remote_url if "://" in self.remote_url else os.path.abspath(self.remote_url)
        commands.append(("remote", "add", "--default", "--force", _REMOTE, url))
        if self.remote_endpoint_url:
            commands.append(("remote", "modify", _REMOTE, "endpointurl", self.remote_endpoint_url))
        return commands

    def _dvc(self, cwd: str, *commands: Sequence[str]) -> str:
        """Run `commands` (DVC argument lists) in order in one interpreter in `cwd`; the first failure raises, naming
        its command."""
        cmd = [sys.executable, "-c", _BATCH, json.dumps([list(c) for c in commands])]
        # No usage reports; DVC's per-repo scratch (locks, indexes) stays inside the repo, not in /var/tmp.
        env = {**os.environ, "DVC_NO_ANALYTICS": "1", "DVC_SITE_CACHE_DIR": os.path.join(cwd, ".dvc", "tmp", "site")}
        try:
            done = subprocess.run(
                cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=self.command_timeout_s, check=False
            )
        except subprocess.TimeoutExpired as e:
            failed, err = _last_command(_text(e.stderr), commands)
            raise DataVersioningError(
                f"`dvc {' '.join(failed)}` in {cwd} did not finish within {self.command_timeout_s}s; "
                f"output so far:\n{_text(e.stdout)}{err}"
            ) from e
        if done.returncode != 0:
            failed, err = _last_command(done.stderr, commands)
            output = f"{done.stdout}{err}"
            # A full disk is not a DVC problem to debug: say it first (trainyard.store.no_space).
            cause = "no space left on device; free space and run again. " if no_space(Exception(output)) else ""
            raise DataVersioningError(
                f"{cause}`dvc {' '.join(failed)}` in {cwd} failed with exit code {done.returncode}:\n{output}".rstrip()
            )
        return done.stdout


def _last_command(stderr: str, commands: Sequence[Sequence[str]]) -> tuple[Sequence[str], str]:
    """The command a batch was running when it ended (the last one announced) and the stderr it wrote."""
    head, mark, tail = stderr.rpartition(_MARK)
    if not mark:
        return commands[0], stderr  # the interpreter failed before the first command (DVC not importable)
    number, _, err = tail.partition("\n")
    return commands[int(number)] if number.isdigit() and int(number) < len(commands) else commands[-1], err


def _text(data: Optional[bytes | str]) -> str:
    if data is None:
        return ""
    return data.decode(errors="replace") if isinstance(data, bytes) else data


