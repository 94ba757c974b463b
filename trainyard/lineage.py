"""The lineage record of a trained model, and the one definition of every registry tag name.

A trial's record says what data, code, environment and settings produced it.
The same record goes to the W&B run config (`LineageRecord.to_config`, also the
`lineage` of the `TrainSpec` and of `result.json`), to Dagster metadata
(`to_metadata`) and, with what registration adds (trial, test split, policy,
validation, metrics), to the MLflow version tags (`to_tags`, read back by
`from_tags`), so any registered model can be traced and rebuilt.

Tags are `trainyard.<field>` strings; nested mappings (`params`, `hparams`,
`feast`) are flattened to `trainyard.params.<name>`, metrics are
`trainyard.metric.<name>`.

A model trained on a Feast source also carries, in its MLflow model's
`metadata` (`feast_serving`), what serving needs to fetch its inputs from the
online store: each input column's feature reference, the feature service and
the entity keys.
The other tag names trainyard writes (the promotion decision, the handoff, the
champion history, the registry's lock) are defined here too, so that a tag
name is spelled once.

Example:
    >>> rec = LineageRecord(pipeline="vision/digits", data_version="ab12", seed=0)
    >>> rec.to_tags()
    {'trainyard.pipeline': 'vision/digits', 'trainyard.data_version': 'ab12', 'trainyard.seed': '0'}
    >>> LineageRecord.from_tags(rec.to_tags()) == rec
    True
"""

from __future__ import annotations

import ast
import functools
import hashlib
import subprocess
from pathlib import Path
from typing import Any, ClassVar, Mapping, Optional, Sequence

from pydantic import BaseModel, ConfigDict, ValidationError

from common.settings import settings
from trainyard.project import package_dir, project_dir
from trainyard.spec import PipelineSpec

LOCK_FILE_ENV = "TRAINYARD_LOCK_FILE"


def lock_file(env: Optional[Mapping[str, str]] = None) -> Path:
    """The dependency lock: `TRAINYARD_LOCK_FILE`, else the project directory's `constraints.txt`
    (`trainyard.project`)."""
    return settings(env).lock_file or project_dir(env) / "constraints.txt"

PREFIX = "trainyard."
"""Every registry tag trainyard writes starts with this."""

# Tags of a registered version written at registration (the lineage record's fields).
PIPELINE_TAG = "trainyard.pipeline"
DATA_VERSION_TAG = "trainyard.data_version"
CODE_VERSION_TAG = "trainyard.code_version"
LOCK_HASH_TAG = "trainyard.lock_hash"
CHECKPOINT_URI_TAG = "trainyard.checkpoint_uri"
TEST_SPLIT_TAG = "trainyard.test_split"
TEST_URI_TAG = "trainyard.test_uri"
TARGET_TAG = "trainyard.target"
POLICY_TAG = "trainyard.promotion_policy"
VALIDATION_TAG = "trainyard.validation"
VALIDATION_SUMMARY_TAG = "trainyard.validation.summary"
PARAMS_PREFIX = "trainyard.params."
HPARAMS_PREFIX = "trainyard.hparams."
METRIC_PREFIX = "trainyard.metric."

FEAST_PREFIX = "trainyard.feast."
"""Tags of a version trained on a Feast source (`LineageRecord.feast`): `features`, `feature_service`, `feature_views`
(name@definition), `time_range`, `entity_md5`."""
FEAST_MODEL_METADATA_KEY = "feast"
"""The key of `feast_serving`'s mapping in a registered MLflow model's `metadata` (the MLmodel file)."""
DEFINITION_DIGITS = 12
"""Hex digits of a feature view's definition hash shown in tags, config and cards (`name@0123456789ab`)."""

# Tags of a registered version written by a promotion decision and its handoff.
PROMOTION_PREFIX = "trainyard.promotion."
PROMOTION_REASON_TAG = "trainyard.promotion.reason"
SMOKE_PASSED_TAG = "trainyard.smoke.passed"
SMOKE_EVIDENCE_TAG = "trainyard.smoke.evidence"
CHAMPION_REPLACED_TAG = "trainyard.champion.replaced"
CHAMPION_ROLLED_BACK_TAG = "trainyard.champion.rolled_back"
HANDOFF_URI_TAG = "trainyard.handoff.event_uri"
HANDOFF_WEBHOOK_TAG = "trainyard.handoff.webhook"

# Tags the registry client writes itself.
TRIAL_KEY_TAG = "trainyard.trial_key"
"""Version tag `<study>/<trial>`: registering the same trial twice returns the existing version."""
LOCK_OWNER_TAG = "trainyard.lock.owner"
LOCK_EXPIRES_TAG = "trainyard.lock.expires_at"
LOCK_PURPOSE_TAG = "trainyard.lock.purpose"

# Tags of a registered model (not of a version).
HISTORY_TAG = "trainyard.champion.history"
"""JSON `{"stack": [versions], "log": [changes]}`; a rollback pops the stack."""


class LineageError(ValueError):
    """A lineage record cannot be read: a required tag is missing or a value is malformed."""


@functools.lru_cache(maxsize=1)
def code_version(root: Optional[str] = None) -> tuple[str, bool]:
    """(git commit, dirty flag) of the code this process runs; ('unknown', True) when it is not a git checkout.

    `root` (default: the directory holding the imported `trainyard` package, `trainyard.project.package_dir`)
    counts only when it is the top of a git checkout: the editable install's source tree. A wheel in
    site-packages is not, even in a virtual environment kept inside a checkout, whose commit says
    nothing of the installed code. An image built without `.git` gives the commit it was built from
    in `TRAINYARD_CODE_VERSION` (`<commit>`, or `<commit>-dirty` from a dirty tree).
    """
    root = str(package_dir("trainyard").parent) if root is None else root
    try:
        top, commit = subprocess.run(["git", "rev-parse", "--show-toplevel", "HEAD"], cwd=root, capture_output=True,
                                     text=True, check=True).stdout.splitlines()
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, ValueError, subprocess.CalledProcessError):
        top = ""
    if not top or Path(top).resolve() != Path(root).resolve():
        built = settings().code_version or ""  # stripped; unset or blank: none
        if built and built.removesuffix("-dirty") not in ("", "unknown"):
            return built.removesuffix("-dirty"), built.endswith("-dirty")
        return "unknown", True
    return commit, bool(status.strip())


def lock_hash(path: Optional[Path] = None) -> str:
    """First 16 hex digits of the dependency lock's sha256 (default: `lock_file()`); 'unknown' without one."""
    path = lock_file() if path is None else path
    if not path.exists():
        return "unknown"
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def flatten(record: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings as one level with dotted keys: `{"a": {"b": 1}}` -> `{"a.b": 1}`."""
    out: dict[str, Any] = {}
    for k, v in record.items():
        if isinstance(v, Mapping):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


class LineageRecord(BaseModel):
    """What produced a model: the trial's record, and what registration adds to it.

    Every field is optional except `pipeline` and `data_version`; a field is
    written (as a tag, config key or metadata entry) only when it was given,
    even when given as None, so records written before a field existed read
    back unchanged.

    Attributes:
        pipeline: The pipeline key `<team>/<pipeline>`.
        data_version: DVC md5 of the raw snapshot trained on.
        params: The trial's sampled hyperparameters.
        hparams: The spec's fixed hyperparameters.
        determinism_caveats: What the pod said limits bit-exact reproduction.
        trial, study, checkpoint_uri, tracker_run: The registered trial (registration only).
        test_split, test_uri, target: The pinned held-out split it was evaluated on.
        promotion_policy: The `PromotionSpec` as JSON, as declared at registration.
        validation: `passed` or `failed`; `validation_summary` says why.
        metrics: Held-out test metrics (`trainyard.metric.<name>`, written with `repr`).
        feast: For a Feast source, `feast_fields` of the retrieval: feature references,
            feature service, views as `name@definition`, event-time range, entity snapshot
            (`trainyard.feast.<name>`).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    pipeline: str
    data_version: str
    pipeline_fingerprint: Optional[str] = None
    code_version: Optional[str] = None
    code_dirty: Optional[bool] = None
    lock_hash: Optional[str] = None
    seed: Optional[int] = None
    world_size: Optional[int] = None
    strategy: Optional[str] = None
    params: dict[str, Any] = {}
    hparams: dict[str, Any] = {}
    model: Optional[str] = None
    max_epochs: Optional[int] = None
    batch_size: Optional[int] = None
    determinism_caveats: Optional[list[str]] = None
    trial: Optional[str] = None
    study: Optional[str] = None
    checkpoint_uri: Optional[str] = None
    tracker_run: Optional[str] = None
    test_split: Optional[str] = None
    test_uri: Optional[str] = None
    target: Optional[str] = None
    promotion_policy: Optional[str] = None
    validation: Optional[str] = None
    validation_summary: Optional[str] = None
    metrics: dict[str, float] = {}
    feast: dict[str, str] = {}

    TRIAL_FIELDS: ClassVar[tuple[str, ...]] = (
        "pipeline",
        "pipeline_fingerprint",
        "data_version",
        "code_version",
        "code_dirty",
        "lock_hash",
        "seed",
        "world_size",
        "strategy",
        "params",
        "hparams",
        "model",
        "max_epochs",
        "batch_size",
        "determinism_caveats",
        "feast",
    )
    """The fields of a trial's record (`to_config`), in the order it has always been written (`feast` only for a Feast
    source)."""
    _NESTED: ClassVar[dict[str, str]] = {
        "params": PARAMS_PREFIX,
        "hparams": HPARAMS_PREFIX,
        "metrics": METRIC_PREFIX,
        "feast": FEAST_PREFIX,
    }
    _INTS: ClassVar[tuple[str, ...]] = ("seed", "world_size", "max_epochs", "batch_size")

    @classmethod
    def tag(cls, name: str) -> str:
        """The registry tag of scalar field `name` (`validation_summary` is `trainyard.validation.summary`).

        Raises:
            LineageError: `name` is not a scalar field of the record.
        """
        if name not in cls.model_fields or name in cls._NESTED:
            scalars = [f for f in cls.model_fields if f not in cls._NESTED]
            raise LineageError(f"lineage field {name!r} has no tag of its own; scalar fields are {scalars}")
        return VALIDATION_SUMMARY_TAG if name == "validation_summary" else f"{PREFIX}{name}"

    @classmethod
    def from_config(cls, record: Mapping[str, Any], **registration: Any) -> "LineageRecord":
        """The record from a trial's lineage dict (`to_config`'s form), plus registration fields.

        Raises:
            LineageError: An unknown key, a missing `pipeline`/`data_version`, or a value of the wrong type.
        """
        try:
            return cls.model_validate({**record, **registration})
        except ValidationError as e:
            raise LineageError(f"lineage record is not valid: {e}") from e

    @classmethod
    def from_tags(cls, tags: Mapping[str, str]) -> "LineageRecord":
        """The record from a registered version's tags; other tags (decision, handoff, lock, not trainyard's) are
        ignored.

        Raises:
            LineageError: `trainyard.pipeline` or `trainyard.data_version` is missing, or a value
                cannot be read as its field's type (the message names the tag and the value).
        """
        values: dict[str, Any] = {}
        for name in cls.model_fields:
            if name in cls._NESTED:
                prefix = cls._NESTED[name]
                found = {k[len(prefix):]: v for k, v in tags.items() if k.startswith(prefix)}
                if found:
                    values[name] = {k: _metric(prefix + k, v) for k, v in found.items()} if name == "metrics" else found
            elif cls.tag(name) in tags:
                values[name] = _parse(name, cls.tag(name), tags[cls.tag(name)])
        for required in ("pipeline", "data_version"):
            if required not in values:
                raise LineageError(f"tag {cls.tag(required)} is missing: the version was not registered by trainyard")
        return cls.from_config(values)

    def to_tags(self) -> dict[str, str]:
        """The registry tags of the fields that were given: `str(value)`, metrics as `repr(value)`."""
        tags: dict[str, str] = {}
        for name in self.model_fields:
            if name not in self.model_fields_set:
                continue
            value = getattr(self, name)
            if name == "metrics":
                tags.update({f"{METRIC_PREFIX}{k}": repr(v) for k, v in value.items()})
            elif name in self._NESTED:
                tags.update({f"{self._NESTED[name]}{k}": str(v) for k, v in flatten(value).items()})
            else:
                tags[self.tag(name)] = str(value)
        return tags

    def to_config(self) -> dict[str, Any]:
        """The trial's record as a nested dict: the W&B run config, `TrainSpec.lineage` and `result.json`'s lineage."""
        return {name: getattr(self, name) for name in self.TRIAL_FIELDS if name in self.model_fields_set}

    def to_metadata(self) -> dict[str, Any]:
        """Dagster metadata: every given field as one plain entry (`params.lr`, `metric.test_acc`, ...)."""
        given = {name: getattr(self, name) for name in self.model_fields if name in self.model_fields_set}
        given["metric"] = given.pop("metrics", {})
        return {k: v for k, v in flatten(given).items()}


def feast_fields(lineage: Mapping[str, Any]) -> dict[str, str]:
    """`LineageRecord.feast` of a Feast source's lineage (`raw/<md5>/feast.json`): references, service, views with their
    definitions, time range.

    Values are strings, as the registry tags hold them, so a record read back
    from its tags equals the one that wrote them.

    Example:
        >>> feast_fields({"features": ["stats:balance"], "feature_service": {"name": "churn"}, "entity_md5": "e1",
        ...               "feature_views": [{"name": "stats", "definition": "ab" * 32}],
        ...               "time_range": ["2024-01-01", "2024-03-01"]})  # doctest: +NORMALIZE_WHITESPACE
        {'features': 'stats:balance', 'feature_service': 'churn', 'feature_views': 'stats@abababababab',
         'time_range': '2024-01-01/2024-03-01', 'entity_md5': 'e1'}
    """
    service = lineage.get("feature_service") or {}
    return {
        "features": ",".join(lineage["features"]),
        "feature_service": str(service.get("name", "")),
        "feature_views": ",".join(_view_version(v) for v in lineage["feature_views"]),
        "time_range": "/".join(str(t) for t in lineage["time_range"]),
        "entity_md5": str(lineage["entity_md5"]),
    }


def feast_serving(lineage: Mapping[str, Any], inputs: Sequence[str], keys: Sequence[str]) -> dict[str, Any]:
    """What serving needs to fetch a model's inputs from Feast's online store, for its MLflow model `metadata`.

    The model's signature names its input columns; this maps each of them to
    the feature reference it was retrieved by (`view:feature`, the column being
    the feature's name), in the signature's order, so a server can call
    `get_online_features(features=[...], entity_rows=[{key: ...}])` and pass
    the answer's columns to the model.

    Args:
        lineage: The Feast lineage of the data version trained on (`raw/<md5>/feast.json`).
        inputs: The model's input columns, in signature order.
        keys: The source's entity key columns (what a request to the online store names).

    Returns:
        `{"project", "feature_service" (None when references were listed), "entity_keys",
        "features": {input column: reference}, "feature_views": ["name@definition", ...]}`.

    Raises:
        LineageError: An input column has no feature reference, or two references give the same column.
    """
    columns = [ref.split(":", 1)[1] for ref in lineage["features"]]
    repeated = sorted({c for c in columns if columns.count(c) > 1})
    if repeated:
        raise LineageError(
            f"feature references {lineage['features']} give column(s) {repeated} more than once; serving could not "
            "tell them apart"
        )
    by_column = dict(zip(columns, lineage["features"]))
    missing = [c for c in inputs if c not in by_column]
    if missing:
        raise LineageError(
            f"model input column(s) {missing} have no Feast feature reference; the retrieval's references are "
            f"{lineage['features']}"
        )
    return {
        "project": lineage.get("project"),
        "feature_service": (lineage.get("feature_service") or {}).get("name"),
        "entity_keys": list(keys),
        "features": {c: by_column[c] for c in inputs},
        "feature_views": [_view_version(v) for v in lineage["feature_views"]],
    }


def _view_version(view: Mapping[str, Any]) -> str:
    return f"{view['name']}@{view['definition'][:DEFINITION_DIGITS]}"


def feast_card(lineage: Mapping[str, Any]) -> str:
    """A model card section naming the Feast features, views (with definition hash and version) and the retrieval's time
    range."""
    service = (lineage.get("feature_service") or {}).get("name")
    lines = [
        "",
        "## Features (Feast)",
        "",
        f"- feature service: {service or '(none; references listed)'}",
        f"- entity rows: {lineage['entity_md5']}, event times {' .. '.join(str(t) for t in lineage['time_range'])}",
        "- feature references: " + ", ".join(f"`{r}`" for r in lineage["features"]),
        "",
        "| view | definition | version | ttl (s) |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {v['name']} | {v['definition'][:DEFINITION_DIGITS]} | {v.get('version')} | {v.get('ttl_s')} |"
        for v in lineage["feature_views"]
    ]
    return "\n".join(lines) + "\n"


def _parse(name: str, tag: str, raw: str) -> Any:
    """A scalar tag value as its field's type; 'None' is None (a field that was given as None)."""
    if raw == "None" and name not in ("pipeline", "data_version"):
        return None
    if name == "code_dirty":
        if raw not in ("True", "False"):
            raise LineageError(f"tag {tag} is {raw!r}; expected 'True' or 'False'")
        return raw == "True"
    if name in LineageRecord._INTS:
        try:
            return int(raw)
        except ValueError as e:
            raise LineageError(f"tag {tag} is {raw!r}; expected an integer") from e
    if name == "determinism_caveats":
        try:
            caveats = ast.literal_eval(raw)
        except (ValueError, SyntaxError) as e:
            raise LineageError(f"tag {tag} is {raw!r}; expected a list of strings") from e
        if not isinstance(caveats, list):
            raise LineageError(f"tag {tag} is {raw!r}; expected a list of strings")
        return caveats
    return raw


def _metric(tag: str, raw: str) -> float:
    try:
        return float(raw)
    except ValueError as e:
        raise LineageError(f"tag {tag} is {raw!r}; expected a number") from e


def record(
    spec: PipelineSpec, data_version: str, params: dict[str, Any], seed: int, feast: Optional[Mapping[str, Any]] = None,
) -> dict[str, Any]:
    """A trial's lineage record (`LineageRecord.to_config` form) for this checkout and environment.

    Args:
        feast: The Feast lineage of `data_version` (`raw/<md5>/feast.json`) when the
            source is a feature store; its `feast_fields` become the record's `feast`.
    """
    commit, dirty = code_version()
    extra = {"feast": feast_fields(feast)} if feast is not None else {}
    return LineageRecord(
        pipeline=spec.key,
        pipeline_fingerprint=spec.fingerprint(),
        data_version=data_version,
        code_version=commit,
        code_dirty=dirty,
        lock_hash=lock_hash(),
        seed=seed,
        world_size=spec.distribution.world_size,
        strategy=spec.distribution.strategy,
        params=dict(params),
        hparams=dict(spec.model.hparams),
        model=spec.model.path,
        max_epochs=spec.model.max_epochs,
        batch_size=spec.model.batch_size,
        **extra,
    ).to_config()
