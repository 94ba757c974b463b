"""The run-worker zygote: `python -m instance.zygote <dir>`, the process `WarmRunLauncher` forks run workers from.

It loads Dagster, the instance and the code location once (with one thread in each native pool: a fork server
must hold none), then serves fork requests on `<dir>/sock` until its parent goes. Before each fork it checks that
no loaded file of the code location and no installed distribution changed since it loaded; if one did, it exits
and the launcher starts a new one, so a run never executes stale code. `instance.run_launcher` says how the
launcher starts, asks and watches it (docs/architecture-notes.md, "Run workers forked from a warm process").
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import sys
import sysconfig
import tempfile
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

from common import installed
from common.proc import restore_thread_counts, thread_names
from instance.run_launcher import PREMADE, REQUEST_TIMEOUT_SECONDS, RUN_PRELOAD, run_temp_dir


def _installation_dirs() -> list[str]:
    paths = sysconfig.get_paths()
    dirs = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    dirs |= {sys.prefix, sys.base_prefix, sys.exec_prefix}
    return sorted(os.path.realpath(d) + os.sep for d in dirs)


def _loaded_files() -> dict[str, tuple[int, int]]:
    """(mtime_ns, size) of every loaded module's file outside the Python installation (the code that can change)."""
    outside: dict[str, tuple[int, int]] = {}
    installed = _installation_dirs()
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if not path:
            continue
        real = os.path.realpath(path)
        if any(real.startswith(d) for d in installed):
            continue
        try:
            st = os.stat(real)
        except OSError:
            continue
        outside[real] = (st.st_mtime_ns, st.st_size)
    return outside


def _changed(files: dict[str, tuple[int, int]]) -> Optional[str]:
    for path, seen in files.items():
        try:
            st = os.stat(path)
        except OSError:
            return path
        if (st.st_mtime_ns, st.st_size) != seen:
            return path
    return None


def _child(run_id: str, instance_ref: Any, premade: Any = None) -> int:
    """The forked run worker: what `dagster api execute_run` does after its imports.

    `premade`: the instance the zygote made from `instance_ref` before forking (its storages hold no connection
    then), used instead of making one per run (0.03 s alone, 0.16 s with two runs starting at once); None makes one.
    The `.env` file of the working directory is read for each run either way, as Dagster's CLI does.
    """
    import logging

    from dagster._cli.api import _execute_run_command_body
    from dagster._cli.utils import get_instance_for_cli
    from dagster._utils.interrupts import capture_interrupts

    from instance.storage_connections import hold_connections

    # The run's temporary files in a folder of its own, removed at its end, or by run monitoring if it is killed.
    scratch = run_temp_dir(run_id)
    os.makedirs(scratch, exist_ok=True)
    os.environ["TMPDIR"] = tempfile.tempdir = scratch
    try:
        with capture_interrupts():
            with (
                get_instance_for_cli(instance_ref=instance_ref)
                if premade is None
                else _premade(premade, logging.getLogger("dagster")) as instance
            ):
                hold_connections(instance)  # before the run's first query
                return _execute_run_command_body(run_id, instance, lambda event: None, set_exit_code_on_failure=False)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


@contextlib.contextmanager
def _premade(instance: Any, logger: Any) -> Iterator[Any]:
    """`get_instance_for_cli` for an instance made before the fork: the `.env` variables around it, disposed at the
    end."""
    from dagster._cli.utils import _inject_local_env_file

    with _inject_local_env_file(logger), instance:
        yield instance


def _make_instance(ref: Any) -> Any:
    """The instance of `ref`, made in the zygote for its forked workers; None when it cannot be (each run then makes its
    own)."""
    import logging

    from dagster import DagsterInstance
    from dagster._cli.utils import _inject_local_env_file

    try:
        with _inject_local_env_file(logging.getLogger("dagster")):
            instance = DagsterInstance.from_ref(ref)
    except Exception:  # the run worker makes it, and reports why it cannot, as Dagster's would
        return None
    setattr(instance, PREMADE, True)
    return instance


def _warm(directory: Path) -> tuple[dict[str, tuple[int, int]], Any, Any]:
    """Import what a run worker of this location imports: Dagster's run path, the storages, the location's
    definitions."""
    import importlib

    import dagster._cli.api  # the run worker's entry point
    import dagster._core.execution.api  # noqa: F401
    from dagster._core.instance.ref import InstanceRef
    from dagster._core.origin import RepositoryPythonOrigin
    from dagster._serdes import deserialize_value
    from dagster._utils.hosted_user_process import recon_repository_from_origin

    ref = deserialize_value((directory / "instance.json").read_text(), InstanceRef)
    for data in (
        ref.run_storage_data,
        ref.event_storage_data,
        ref.schedule_storage_data,
        ref.compute_logs_data,
        ref.local_artifact_storage_data,
    ):
        if data is not None:
            importlib.import_module(data.module_name)
    origin = deserialize_value((directory / "origin.json").read_text(), RepositoryPythonOrigin)
    recon_repository_from_origin(origin).get_definition()  # imports the location's module and builds its definitions
    for name in RUN_PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            continue
    return _loaded_files(), ref, _make_instance(ref)


def _stale(files: dict[str, tuple[int, int]], distributions: installed.Snapshot, paths: list[str]) -> Optional[str]:
    """What changed since the zygote loaded: a module file outside the installation, or a distribution installed,
    upgraded or removed on its `sys.path` (`common.installed`: a `pip install` replaces its `.dist-info`)."""
    return _changed(files) or installed.changed(distributions, paths)


def serve(directory: Path) -> None:
    """Load, then fork a run worker per request on `<directory>/sock` until the parent goes (see the module
    docstring)."""
    parent = os.getppid()
    try:
        files, instance_ref, instance = _warm(directory)
        paths = list(sys.path)
        distributions = installed.snapshot(paths)
        threads = thread_names()  # native threads too (OpenBLAS's pool, jemalloc's purger), as the trial server checks
        if len(threads) != 1:  # a fork copies no thread but every lock they hold: refuse rather than deadlock a run
            raise RuntimeError(
                f"loading the code location left threads running ({threads[1:]}); runs are started the default way"
            )
        _restore_environ(directory)
    except BaseException as e:  # the launcher reads why and starts runs the default way
        (directory / "error.txt").write_text(f"{type(e).__name__}: {e}")
        raise
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(directory / "sock"))
    listener.listen(16)
    listener.settimeout(1.0)
    (directory / "ready").touch()
    try:
        while os.getppid() == parent:
            _reap()
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(REQUEST_TIMEOUT_SECONDS)
                request = json.loads(conn.makefile("rb").readline())
                stale = _stale(files, distributions, paths)
                if stale:
                    conn.sendall(json.dumps({"stale": stale}).encode() + b"\n")
                    return
                pid = os.fork()
                if pid == 0:
                    code = 1
                    try:
                        listener.close()
                        conn.close()
                        # its own session, as a spawned worker: a signal to the zygote's group does not reach it
                        os.setsid()
                        restore_thread_counts(os.environ)  # what a spawned worker's BLAS and OpenMP pools would have
                        code = _child(request["run_id"], instance_ref, instance)
                    except BaseException:
                        traceback.print_exc()  # the run's own failure is in its events; this is the worker's
                    finally:
                        sys.stdout.flush()
                        sys.stderr.flush()
                        os._exit(code)
                conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
    finally:
        listener.close()
        shutil.rmtree(
            directory, ignore_errors=True
        )  # its socket and files: the launcher starts a fresh one in a new directory


def _restore_environ(directory: Path) -> None:
    """Put back the variables the zygote was started without (`environ.json`), for its run workers and their
    children."""
    try:
        original = json.loads((directory / "environ.json").read_text())
    except FileNotFoundError:
        return
    for name, value in original.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def _reap() -> None:
    """Collect forked run workers that ended (they are the zygote's children)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


if __name__ == "__main__":
    serve(Path(sys.argv[1]))
