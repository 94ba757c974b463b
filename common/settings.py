"""Every `TRAINYARD_*` environment variable the platform reads, declared once: name, type, default, meaning, reader.

`Settings` is a pydantic-settings model: one field per variable (`home` is
`TRAINYARD_HOME`), parsed and checked here, so a caller never parses a variable
itself. docs/configuration.md is its table (`python -m common.settings` prints
it; tests/test_settings.py holds the two the same), and tests/test_settings_reads.py
fails on a read of a `TRAINYARD_*` variable anywhere else in the production packages.

Read the settings at the call, never once at import: `settings()` reads this
process's environment as it is now (a test's `monkeypatch.setenv` is seen by the
next call), `settings(env)` a mapping a caller builds (a team's environment, the
environment of a child process). Each distinct set of values is validated once
and kept (`_validated`), so a call costs 34 dictionary look-ups and a cache hit:
3 us for a given mapping, 15-50 us for `os.environ` (whose look-up of an unset
name raises and catches a KeyError), against about 1 ms for a validation; cheap
enough for the warm workers' fork path and a worker's start (nothing reads it per step).

A variable set to the empty string counts as unset, but where a field says
otherwise (`TRAINYARD_K8S_QUEUE`: empty means no queue; `TRAINYARD_LAUNCH_ID`
is kept as given). A value that does not parse raises `SettingsError`, which
names every bad variable with its value.

Code that *sets* a variable for a child process writes the environment by the
variable's name (`NAMES`, or the constants beside the code that sets it).

Example:
    >>> settings({"TRAINYARD_ENV": "cluster", "TRAINYARD_K8S_SECRETS": "aws, wandb"}).k8s_secrets
    ('aws', 'wandb')
    >>> settings({}).warm_workers
    True
    >>> try:
    ...     settings({"TRAINYARD_WARM_WORKERS": "maybe"})
    ... except SettingsError as e:
    ...     print(e)
    TRAINYARD_WARM_WORKERS='maybe': expected one of ['0', '1', 'false', 'no', 'off', 'on', 'true', 'yes']
"""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path
from typing import Annotated, Any, Callable, Literal, Mapping, Optional

from pydantic import AliasGenerator, BeforeValidator, Field, ValidationError
from pydantic_settings import BaseSettings, NoDecode, PydanticBaseSettingsSource, SettingsConfigDict

__all__ = ["ENVIRONMENTS", "NAMES", "PREFIX", "READERS", "Settings", "SettingsError", "markdown_table", "settings"]

PREFIX = "TRAINYARD_"
ENVIRONMENTS = ("local", "cluster")
"""The environments `TRAINYARD_ENV` may name (pipelines/environments.py builds each)."""
READERS = ("orchestrator", "pod", "both")
_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")


class SettingsError(ValueError):
    """One or more `TRAINYARD_*` variables hold a value that does not parse; the message names each with its value."""


def _unset_if_empty(value: Any) -> Any:
    return None if value == "" else value


def _switch(value: Any) -> Any:
    """A boolean word ('1', 'true', 'yes', 'on' and their opposites, any case); empty or unset: the default."""
    if not isinstance(value, str):
        return value
    word = value.strip().lower()
    if word in _ON:
        return True
    if word in _OFF:
        return False
    raise ValueError(f"expected one of {sorted(_ON + _OFF)}")


def _count(unit: str) -> Callable[[Any], Any]:
    """A whole number of `unit` written as digits ('0', '1', ...); empty or unset: the default."""

    def parse(value: Any) -> Any:
        if not isinstance(value, str):
            return value
        if value == "":
            return None
        if not value.isdigit():
            raise ValueError(f"is not a number of {unit}; accepted: 0, 1, 2, ...")
        return int(value)

    return parse


def _gib(value: Any) -> Any:
    if not isinstance(value, str):
        return value
    if value == "":
        return None
    try:
        number = float(value)
    except ValueError:
        raise ValueError("is not a number of GiB, e.g. '79.6'") from None
    if not number > 0:
        raise ValueError("must be > 0 GiB")
    return number


def _one_of(choices: tuple[str, ...], what: str) -> Callable[[Any], Any]:
    def parse(value: Any) -> Any:
        if value is None or value == "":
            return None
        if value not in choices:
            raise ValueError(f"is not {what}; use one of {list(choices)}")
        return value

    return parse


def _names(value: Any) -> Any:
    """Comma-separated names, blanks around each dropped: 'a, b,' is ('a', 'b')."""
    return tuple(s.strip() for s in value.split(",") if s.strip()) if isinstance(value, str) else value


def _json_object_with_type(value: Any) -> Any:
    if not isinstance(value, str):
        return value
    if value == "":
        return None
    try:
        parsed = json.loads(value)
    except ValueError as e:
        raise ValueError(
            f'is not JSON ({e}); give an offline store configuration, e.g. \'{{"type": "duckdb"}}\''
        ) from None
    if not isinstance(parsed, dict) or "type" not in parsed:
        raise ValueError("must be a JSON object with a 'type', e.g. '{\"type\": \"duckdb\"}'")
    return parsed


def _stripped(value: Any) -> Any:
    return (value.strip() or None) if isinstance(value, str) else value


def _fd(value: Any) -> Any:
    if not isinstance(value, str) or value == "":
        return None if value == "" else value
    if not value.isdigit():
        raise ValueError("is not a file descriptor number")
    return int(value)


Text = Annotated[Optional[str], BeforeValidator(_unset_if_empty)]
Dir = Annotated[Optional[Path], BeforeValidator(_unset_if_empty)]
Switch = Annotated[bool, BeforeValidator(_switch)]
Seconds = Annotated[Optional[int], BeforeValidator(_count("seconds"))]


def _var(
    default: Any, description: str, read_by: str, *, shown: Optional[str] = None, kind: Optional[str] = None
) -> Any:
    """A field: its default, one line of meaning, who reads it; `shown`/`kind`: the default and type as the table writes
    them."""
    assert read_by in READERS, read_by
    return Field(
        default, description=description, json_schema_extra={"read_by": read_by, "shown_default": shown, "kind": kind}
    )


class Settings(BaseSettings):
    """The platform's settings, one field per `TRAINYARD_*` variable (the field's name upper-cased, after the prefix).

    Build it with `settings()` (cached, this process's environment or a given mapping); `Settings()` reads
    the environment through pydantic-settings, uncached, with pydantic's own error messages.
    """

    model_config = SettingsConfigDict(
        alias_generator=AliasGenerator(validation_alias=lambda name: PREFIX + name.upper()),
        case_sensitive=True, frozen=True, extra="ignore",
    )

    # Where and how: the environment, its state folder, the project.
    env: Annotated[
        Literal["local", "cluster"],
        BeforeValidator(_one_of(ENVIRONMENTS, "an environment")),
        BeforeValidator(lambda v: "local" if v in (None, "") else v),
    ] = _var(
        "local",
        "The environment a code location, CLI command or daemon builds its resources for: `local` or `cluster`.",
        "orchestrator",
    )
    home: Dir = _var(
        None,
        "The state folder: object store, Optuna and MLflow databases, Dagster's home (local); scratch (cluster).",
        "orchestrator",
        shown="local: `<project>/.trainyard`; cluster: `/tmp/trainyard`",
    )
    project_dir: Dir = _var(
        None,
        "The project directory: workspace.yaml, constraints.txt, `.venv-feast`, relative pipeline paths.",
        "orchestrator",
        shown="the current directory",
    )
    user: Text = _var(
        None,
        "Who `trainyard data release` records as releasing a version (`--by` wins).",
        "orchestrator",
        shown="the login name",
    )
    code_version: Annotated[Optional[str], BeforeValidator(_stripped)] = _var(
        None,
        "The commit an image was built from (`<commit>` or `<commit>-dirty`), for lineage where there is no git "
        "checkout.",
        "orchestrator",
        shown="`unknown` outside a checkout",
    )
    lock_file: Dir = _var(None, "The dependency lock recorded in lineage (its hash).", "orchestrator",
                          shown="`<project>/constraints.txt`")

    # Services: object store, studies, tracking, handoff.
    s3_root: Text = _var(
        None, "The cluster environment's object store and DVC remote, an `s3://` URI (required there).", "orchestrator"
    )
    optuna_url: Text = _var(
        None,
        "The Optuna storage URL with its credentials (required in cluster); pods read it by reference.",
        "both",
        shown="local: `sqlite:///<home>/optuna.db`",
    )
    tracking_mode: Annotated[
        Literal["auto", "offline", "online", "disabled"],
        BeforeValidator(lambda v: "auto" if v in (None, "") else v),
        BeforeValidator(_one_of(("auto", "offline", "online", "disabled"), "a W&B tracking mode")),
    ] = _var(
        "auto",
        "W&B in the cluster environment: `auto` (online with WANDB_API_KEY), `offline`, `online` or `disabled`.",
        "orchestrator",
    )
    handoff_webhook: Text = _var(
        None,
        "A URL the handoff publisher POSTs promotions and rollbacks to, read at delivery.",
        "orchestrator",
        shown="none: records only",
    )
    device_memory_gb: Annotated[Optional[float], BeforeValidator(_gib)] = _var(
        None,
        "GiB of one device for the distribution planner, instead of the launcher's or the 79.6 GiB GPU default.",
        "orchestrator",
        kind="number > 0",
    )

    # Feature store sources (docs/data.md).
    feast_python: Text = _var(
        None,
        "The Feast interpreter, a Python with feast installed (its own lock).",
        "orchestrator",
        shown="`<project>/.venv-feast/bin/python`",
    )
    feast_registry: Text = _var(
        None,
        "The Feast registry, a path or URI without a password, for every feature repository.",
        "orchestrator",
        shown="each repository's own",
    )
    feast_offline_store: Annotated[Optional[dict[str, Any]], NoDecode, BeforeValidator(_json_object_with_type)] = _var(
        None,
        'The Feast offline store configuration, a JSON object with a `type`, e.g. `{"type": "duckdb"}`.',
        "orchestrator",
        shown="each repository's own",
        kind="JSON object",
    )

    # Kubernetes: the platform's defaults for trial pods and Jobs (docs/kubernetes.md); a team's pod settings go on top.
    k8s_namespace: Text = _var(None, "The team's namespace, where trials run (required in cluster).", "orchestrator")
    trainer_image: Text = _var(
        None, "The trainer image of trial pods (required unless the pod settings name one).", "orchestrator"
    )
    k8s_queue: Annotated[Optional[str], BeforeValidator(lambda v: v or None)] = _var(
        "trainyard", "The Kueue LocalQueue trials are submitted to; empty: no Kueue.", "orchestrator")
    k8s_priority_class: Text = _var(None, "The PriorityClass of trial pods.", "orchestrator", shown="none")
    k8s_service_account: Text = _var(
        None, "The service account of trial pods.", "orchestrator", shown="the namespace's default"
    )
    k8s_secrets: Annotated[tuple[str, ...], NoDecode, BeforeValidator(_names)] = _var(
        (),
        "Secrets whose keys every trial pod gets as variables (comma-separated names).",
        "orchestrator",
        shown="none",
        kind="names, comma-separated",
    )
    k8s_gpus_per_pod: Annotated[Optional[int], BeforeValidator(_count("GPUs"))] = _var(
        None, "GPUs per trial pod.", "orchestrator", shown="the pod settings' default", kind="integer ≥ 0")
    k8s_active_deadline_seconds: Seconds = _var(
        None,
        "A trial Job's activeDeadlineSeconds; 0: none.",
        "orchestrator",
        shown="604800 (7 days)",
        kind="integer ≥ 0",
    )
    k8s_stuck_seconds: Seconds = _var(
        None, "How long a pod may sit in an image pull error, crash loop or refused creation before the trial fails.",
        "orchestrator", shown="300", kind="integer ≥ 0")
    k8s_unschedulable_seconds: Seconds = _var(
        None,
        "How long a trial's pods may stay unschedulable before the trial fails.",
        "orchestrator",
        shown="900",
        kind="integer ≥ 0",
    )
    k8s_resize_after_seconds: Seconds = _var(
        None, "How long a gang with a node range waits for a lost node before it continues smaller.", "orchestrator",
        shown="120", kind="integer ≥ 0")
    k8s_gang_kind: Annotated[
        Optional[Literal["jobset", "job"]], BeforeValidator(_one_of(("jobset", "job"), "a gang kind"))
    ] = _var(
        None,
        "What a trial is submitted as: `jobset` or `job`.",
        "orchestrator",
        shown="`jobset`",
        kind="`jobset` or `job`",
    )
    k8s_pod: Text = _var(
        None,
        "The team's pod settings (`PodConfig` as JSON, written by `TeamSpec.environment`), over the above.",
        "orchestrator",
        shown="none",
        kind="JSON (PodConfig)",
    )

    # Warm workers (docs/architecture-notes.md, "Warm workers").
    warm_workers: Switch = _var(
        True,
        "Local trials fork from a warm worker; off: every trial starts a new interpreter (torchrun).",
        "orchestrator",
        kind="switch",
    )
    warm_dir: Dir = _var(None, "Where warm servers keep their sockets, logs and pid files.", "orchestrator",
                         shown="`${XDG_RUNTIME_DIR:-/tmp}/trainyard-warm-<uid>`")
    warm_run_workers: Switch = _var(
        True,
        "The daemon forks Dagster runs of local code locations from a warm run worker.",
        "orchestrator",
        kind="switch",
    )
    warm_wandb_service: Switch = _var(
        True, "A warm server keeps one W&B service its trials share.", "pod", kind="switch"
    )

    # Set by launchers for the training processes they start; never set by hand.
    launch_id: Annotated[Optional[str], NoDecode] = _var(
        None, "One launch of a trial (the Job's name on Kubernetes): names attempt records and the rendezvous.", "both",
        shown="set by the launcher")
    progress_dir: Text = _var(None, "The gang agent's progress directory, where each rank records its steps.", "pod",
                              shown="set by `training.gang`")
    store_listen_fd: Annotated[Optional[int], BeforeValidator(_fd)] = _var(
        None, "A socket rank 0's TCPStore serves instead of binding MASTER_PORT (consumed on read).", "pod",
        shown="set by the warm supervisor", kind="file descriptor")

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Given values, then the process environment; no .env or secret files."""
        return init_settings, env_settings


NAMES: tuple[str, ...] = tuple(PREFIX + name.upper() for name in Settings.model_fields)
"""Every variable, in the model's order."""
_DEFAULTS = {PREFIX + name.upper(): field.default for name, field in Settings.model_fields.items()}
_KEEPS_EMPTY = frozenset({"TRAINYARD_K8S_QUEUE", "TRAINYARD_LAUNCH_ID"})
"""The variables whose empty value means something (no queue; a launch id as given); any other empty one is unset."""


def settings(env: Optional[Mapping[str, str]] = None) -> Settings:
    """The settings in `env` (default: this process's environment, as it is now).

    Raises:
        SettingsError: a variable holds a value that does not parse (the message names each such variable and value).
    """
    env = os.environ if env is None else env
    return _validated(tuple(env.get(name) for name in NAMES))


@functools.lru_cache(maxsize=64)
def _validated(values: tuple[Optional[str], ...]) -> Settings:
    given = {name: _DEFAULTS[name] if value is None or (value == "" and name not in _KEEPS_EMPTY) else value
             for name, value in zip(NAMES, values)}
    try:
        return Settings.model_validate(given)  # every field given: the environment source adds nothing
    except ValidationError as e:
        raise SettingsError("; ".join(_describe(error) for error in e.errors())) from None


def _describe(error: Any) -> str:
    name = str(error["loc"][0]) if error["loc"] else "?"
    message = str(error["msg"]).removeprefix("Value error, ")
    return f"{name}={error['input']!r}{'' if message.startswith(('is ', 'must ')) else ':'} {message}"


def markdown_table() -> str:
    """The table of docs/configuration.md: variable, type, default, what it does, who reads it."""
    rows = ["| Variable | Type | Default | What it does | Read by |", "|---|---|---|---|---|"]
    for name, field in Settings.model_fields.items():
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        default = extra.get("shown_default") or _shown(field.default)
        rows.append(f"| `{PREFIX}{name.upper()}` | {extra.get('kind') or _kind(field.annotation)} | {default} "
                    f"| {field.description} | {extra['read_by']} |")
    return "\n".join(rows) + "\n"


def _shown(default: Any) -> str:
    if default is None:
        return "unset"
    if isinstance(default, bool):
        return "on" if default else "off"
    return f"`{default}`"


def _kind(annotation: Any) -> str:
    text = str(annotation).replace("typing.", "").replace("pathlib.", "")
    if "Literal" in text:
        return " or ".join(f"`{c}`" for c in getattr(annotation, "__args__", ()) if c is not type(None)) or text
    return {"Optional[str]": "text", "Optional[Path]": "path", "str": "text"}.get(text, text)


if __name__ == "__main__":
    sys.stdout.write(markdown_table())
