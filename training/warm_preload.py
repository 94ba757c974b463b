"""What the warm server imports before it forks (`preload`), and what of that stays the server's.

`training.warm` forks a worker per trial from a server that imported these
modules once. The imports' exit work stays the server's: a fork inherits the
`atexit` callbacks and `weakref.finalize`'s exit-time finalizers of everything
the server imported, and a worker runs `atexit` at its end as an interpreter
would (`training.warm.run_worker`). So each worker's exit ran the server's: it
removed the temporary directories W&B makes at import for media and artifact
staging (the first trial's exit deleted them, and every later trial on that
server that made a `wandb.Image` failed with FileNotFoundError), and it ran
torch's ~300 operator library deregistrations (a model description, two forks,
took 0.28 s instead of 0.34 s without them; a one-epoch trial's launch, about
0.53 s, did not change measurably). `preload` records the callbacks its imports
register (`recording_exit_callbacks`), a worker sets them and the server's
finalizers aside (`disown_server_exit_work`), and the server runs them when it
stops (`run_server_exit_work`). A worker's other exit callbacks (logging,
multiprocessing, file locks) act on its own state and still run, as do the
finalizers and callbacks the trial registers after the fork.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import os
import tempfile
import weakref
from typing import Any, Callable, Iterator

from common.proc import thread_names

# What a trial imports before its first step; `resources.warm` keys servers on the text of `training/`, so a change
# here starts a new server. Optional modules are skipped when absent.
PRELOAD = (
    "torch",
    "lightning",
    "pandas",
    "pyarrow",
    "training.entrypoint",
    "training.lightning_task",
    "training.gbt",
    "training.describe",
)
# Also what a trial imports only at run time, each found to cost a forked worker tenths of a second to a second
# (gbt_overhead): W&B's init imports its launch inputs; the sweep's pruner and a GBT trial's reporter open Optuna's
# SQL storage (SQLAlchemy, its SQLite dialect, Alembic's migration check; psycopg2 for a PostgreSQL study).
PRELOAD_OPTIONAL = (
    "lightgbm",
    "wandb",
    "wandb.sdk.launch.inputs.internal",
    "optuna",
    "optuna.storages._rdb.storage",
    "alembic.migration",
    "alembic.script",
    "sqlalchemy.dialects.sqlite",
    "psycopg2",
    # what Optuna's RDBStorage still imported lazily in a forked worker: its ORM models, SQLAlchemy's ORM and Alembic's
    # command API for the schema check (0.11 s of the pruner's first storage open, 0.04 s with them)
    "optuna.storages._rdb.models",
    "sqlalchemy.orm",
    "alembic.command",
    "alembic.config",
    # the export of the trained model (torch.export's tracer, AOT autograd, the pt2 archive) and the data module's
    # and reporting's run-time imports: 0.4 s of every one-epoch digits trial (sweep_throughput)
    "torch.export._trace",
    "torch._functorch.aot_autograd",
    "torch._functorch.partitioners",
    "torch._export.serde.serialize",
    "torch.export.pt2_archive._package",
    "pyarrow.dataset",
    "pyarrow.pandas_compat",
    "dagster_pipes",
    "training.pipes_store",
    "omegaconf",
    "wandb.wandb_run",
    "torch._export.passes.replace_set_grad_with_hop_pass",
    "torch._export.passes.replace_autocast_with_hop_pass",
    "torch._inductor.ir",
    "torch.fx.experimental.validator",
    # torch._dynamo's exit callback (`dump_compile_times`, run by every worker's exit) imports tabulate to format a log
    # line: 30-60 ms of each worker's exit, which on a recovery holds the restart while the surviving ranks stop
    "tabulate",
)

# The `atexit` callbacks registered while the server imported its modules: W&B's include the cleanup of its
# temporary directories.
SERVER_EXIT_CALLBACKS: list[Callable[..., Any]] = []


@contextlib.contextmanager
def recording_exit_callbacks() -> Iterator[None]:
    """Record in `SERVER_EXIT_CALLBACKS` what `atexit.register` is called with inside the block (modules call it at
    import)."""
    register = atexit.register

    def recording(func: Callable[..., Any], *args: Any, **kwargs: Any) -> Callable[..., Any]:
        SERVER_EXIT_CALLBACKS.append(func)
        return register(func, *args, **kwargs)

    atexit.register = recording  # type: ignore[assignment]
    try:
        yield
    finally:
        atexit.register = register


def disown_server_exit_work() -> None:
    """In a forked worker: set the server's exit-time finalizers and recorded temporary-directory cleanups aside."""
    for finalizer in list(
        getattr(weakref.finalize, "_registry", {})
    ):  # CPython's registry of live finalizers (since 3.4)
        finalizer.atexit = False
    for func in SERVER_EXIT_CALLBACKS:
        if isinstance(getattr(func, "__self__", None), tempfile.TemporaryDirectory):
            atexit.unregister(func)


def run_server_exit_work() -> None:
    """In the server, at its exit: its exit-time finalizers, as a normal exit runs them (they remove its temporary
    directories)."""
    exit_func = getattr(weakref.finalize, "_exitfunc", None)
    if exit_func is not None:
        exit_func()


def threads() -> list[str]:
    """The names of this process's threads, native ones included (`common.proc.thread_names`: the run-worker zygote's
    check too)."""
    return thread_names()


def _freeze_package_list() -> None:
    """List the installed distributions once, for W&B, instead of in every forked worker.

    `wandb.init` records the installed packages (`x_save_requirements`) by
    parsing every distribution's METADATA: 0.5 s of each trial here, the
    largest single cost of a one-epoch digits trial in a warm worker. The list
    is taken once, in the server, and `wandb.util.working_set` returns it; a
    server lives only while site-packages is unchanged (`resources.warm.server_key`
    hashes its distributions' metadata entries, `common.installed`), so the list is
    as current as the modules it preloaded. A W&B without that function is left alone.
    """
    try:
        import wandb.util
    except ImportError:
        return
    if not callable(getattr(wandb.util, "working_set", None)):
        return
    frozen = tuple(wandb.util.working_set())
    wandb.util.working_set = lambda: iter(frozen)


def preload() -> list[str]:
    """Import what a trial needs, single-threaded and with no CUDA context; the modules imported.

    pyarrow's bundled jemalloc starts a background purging thread when loaded;
    it is turned off (unless the environment configures jemalloc itself), as a
    forked child would not have it anyway.

    Raises:
        RuntimeError: an import left a second thread or loaded the CUDA driver,
            after which forking is unsafe.
    """
    os.environ.setdefault("JE_ARROW_MALLOC_CONF", "background_thread:false")
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # torch.cuda.is_available() without a CUDA context
    loaded = []
    with recording_exit_callbacks():  # modules register their exit work at import
        for name in PRELOAD:
            importlib.import_module(name)
            loaded.append(name)
        for name in PRELOAD_OPTIONAL:
            try:
                importlib.import_module(name)
            except ImportError:
                continue
            loaded.append(name)
    _freeze_package_list()
    if "optuna" in loaded:
        from training.pruners import schema_head

        schema_head()  # what each pruned trial's first storage open would read from Optuna's migration scripts
    running = threads()
    if len(running) != 1:
        raise RuntimeError(f"importing {loaded} started threads {running[1:]}; a fork server must stay single-threaded")
    with open("/proc/self/maps") as f:
        if "libcuda.so" in f.read():
            raise RuntimeError(f"importing {loaded} loaded the CUDA driver; a forked worker could not use the GPU")
    return loaded
