"""Rebuild a registered model from its lineage record and prove it is the same model.

`reproduce(ref)`:
1. resolves `<model>@<alias>` or `<model>@<version>` in the registry and reads its
   lineage tags and the trial's `spec.json`;
2. restores the pinned raw snapshot with DVC into a fresh directory, checks its
   md5 against the recorded data version, re-splits it with the pipeline's split
   and compares the splits with the files the trial trained on;
3. compares code version (git commit, dirty flag) and dependency lock hash with
   this checkout: a mismatch is a warning, or a failure with `strict=True`;
4. retrains with the same spec (seed, config, world size) on the restored data;
5. compares the best checkpoint's weights bitwise (CPU) -- for a LightGBM trial
   its served model files (`model.txt`, `preprocessing.json`) byte for byte --
   and the metrics, and writes a report next to the other reproductions in the
   object store.

The re-split is `validated_data`'s own (`trainyard.data.split_snapshot`), so a
table with string, date or category columns (a "yes"/"no" target) re-splits to
the same bytes.

Checkpoints are read as data, never unpickled as code (`training.verify`): a
recorded checkpoint holding pickled code is refused with `ReproductionError`
before anything is retrained.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from pipelines.catalog import find_pipeline
from resources.launcher import LocalLauncher
from resources.registry import ModelRegistry
from resources.storage import ObjectStore
from resources.versioning import DataVersioning, parse_dvc_file
from training.spec import SPEC_FILE, TrackerSpec, TrainSpec
from trainyard import data as dq
from trainyard import lineage, naming
from trainyard.lineage import CHECKPOINT_URI_TAG, LineageError, LineageRecord
from trainyard.spec import PipelineSpec
from trainyard.store import Store


class ReproductionError(Exception):
    """The reproduction could not be attempted (unknown model, missing lineage, strict mismatch)."""


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    warning: bool = False


@dataclass
class Report:
    model: str
    version: str
    checks: list[Check] = field(default_factory=list)
    report_uri: Optional[str] = None

    @property
    def reproduced(self) -> bool:
        return all(c.ok or c.warning for c in self.checks)

    def add(self, name: str, ok: bool, detail: str, warning: bool = False) -> None:
        self.checks.append(Check(name, ok, detail, warning and not ok))

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "version": self.version,
            "reproduced": self.reproduced,
            "checks": [c.__dict__ for c in self.checks],
        }

    def to_markdown(self) -> str:
        lines = [
            f"# Reproduction of {self.model} version {self.version}: "
            f"{'REPRODUCED' if self.reproduced else 'NOT REPRODUCED'}",
            "",
            "| check | result | detail |",
            "|---|---|---|",
        ]
        for c in self.checks:
            verdict = "ok" if c.ok else ("warning" if c.warning else "FAILED")
            lines.append(f"| {c.name} | {verdict} | {c.detail} |")
        return "\n".join(lines)


def parse_ref(ref: str) -> tuple[str, Optional[str], Optional[str]]:
    """`name@champion` -> (name, None, 'champion'); `name@3` -> (name, '3', None)."""
    name, sep, selector = ref.partition("@")
    if not sep or not name or not selector:
        raise ReproductionError(
            f"model reference {ref!r} must be '<model>@<version>' or '<model>@<alias>', e.g. 'vision.digits@champion'"
        )
    return (name, selector, None) if selector.isdigit() else (name, None, selector)


def _sha(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _verify(ref: str, *args: str) -> dict[str, Any]:
    """`python -m training.verify ARGS` (torch stays out of this process): its JSON verdict.

    Raises:
        ReproductionError: a checkpoint was refused (it holds pickled code), or the tool failed.
    """
    proc = subprocess.run([sys.executable, "-m", "training.verify", *args], capture_output=True, text=True, timeout=600)
    try:
        verdict: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError) as e:
        raise ReproductionError(f"{ref}: weight comparison failed: {proc.stderr[-2000:]}") from e
    if verdict.get("refused"):
        raise ReproductionError(f"{ref}: {verdict['error']}")
    return verdict


GBT_MODEL_FILES = ("model.txt", "preprocessing.json")
"""What a LightGBM trial's served model is made of (`training/gbt.py`): the booster (best iteration) and the fitted
preprocessing."""


def _same_model_files(store: ObjectStore, original: str, rebuilt: str) -> tuple[bool, str]:
    """Whether a rebuilt LightGBM model equals the registered one file for file: (identical, detail)."""
    compared, differing, missing = [], [], []
    for name in GBT_MODEL_FILES:
        a, b = f"{original}/{name}", f"{rebuilt}/{name}"
        if not store.exists(a):
            continue  # preprocessing.json only exists where the platform preprocessed
        if not store.exists(b):
            missing.append(name)
            continue
        compared.append(name)
        if hashlib.sha256(store.read_bytes(a)).hexdigest() != hashlib.sha256(store.read_bytes(b)).hexdigest():
            differing.append(name)
    if not compared and not missing:
        return False, f"no LightGBM model file under {original}"
    if missing or differing:
        return (
            False,
            "the rebuilt model differs: "
            f"{', '.join([*(f'{n} differs' for n in differing), *(f'{n} missing' for n in missing)])}",
        )
    return True, f"byte-identical LightGBM model ({', '.join(compared)}), so identical predictions"


def split_as_recorded(pipeline: PipelineSpec, fingerprint: Optional[str]) -> PipelineSpec:
    """`pipeline` with the split method the version was trained on: a version validated before the hash split
    records the fingerprint its definition has with `SplitSpec(method="shuffle")`, and is re-split that way."""
    if fingerprint is None or pipeline.split.method == "shuffle" or pipeline.fingerprint() == fingerprint:
        return pipeline
    shuffled = pipeline.model_copy(update={"split": pipeline.split.model_copy(update={"method": "shuffle"})})
    return shuffled if shuffled.fingerprint() == fingerprint else pipeline


def _check_code_and_environment(ref: str, report: Report, recorded_lineage: LineageRecord, strict: bool) -> None:
    """Report the checkout's code version and dependency lock against the recorded ones (warnings unless `strict`).

    Raises:
        ReproductionError: under `strict`, the code differs from the recorded version.
    """
    commit, dirty = lineage.code_version()
    recorded = recorded_lineage.code_version or "unknown"
    code_ok = commit == recorded and not dirty
    detail = f"recorded {recorded[:12]}, checkout {commit[:12]}{' with uncommitted changes' if dirty else ''}"
    if not code_ok and strict:
        report.add("code version", False, detail)
        raise ReproductionError(f"{ref}: code mismatch ({detail}); rerun without --strict to reproduce anyway")
    report.add("code version", code_ok, detail, warning=True)
    lock = lineage.lock_hash()
    lock_ok = lock == recorded_lineage.lock_hash
    report.add("dependency lock", lock_ok, f"recorded {recorded_lineage.lock_hash}, here {lock}", warning=not strict)


def _restored_splits(
    store: ObjectStore,
    versioning: DataVersioning,
    pipeline: PipelineSpec,
    spec: TrainSpec,
    md5: str,
    tmp: str,
    report: Report,
) -> dict[str, str]:
    """The pinned snapshot `md5`, restored by DVC into `tmp` and split as the pipeline splits; the splits' paths by
    part.

    Reports whether the restored snapshot is the recorded version and whether its splits equal the files the trial
    trained on.
    """
    dvc_text = store.read_bytes(f"{naming.raw_dir(store, pipeline.team, pipeline.name, md5)}/data.parquet.dvc").decode()
    pinned_md5, _, rel = parse_dvc_file(dvc_text)
    restored = versioning.restore(dvc_text, rel, os.path.join(tmp, "restored"))
    with open(restored, "rb") as f:
        restored_md5 = hashlib.md5(f.read()).hexdigest()
    report.add("data version", restored_md5 == md5 == pinned_md5, f"recorded {md5}, restored with DVC {restored_md5}")

    # Split exactly as `validated_data` does (`split_snapshot`: Arrow batches, canonical writer), so string, date
    # and category columns come back byte for byte; a pandas round trip would retype them.
    split_dir = os.path.join(tmp, "splits")
    os.makedirs(split_dir)
    dq.split_snapshot(Store(root=tmp), os.path.abspath(restored), pipeline, split_dir)
    uris = {}
    same = []
    for part in ("train", "val", "test"):
        uris[part] = os.path.join(split_dir, f"{part}.parquet")
        used = getattr(spec.data, f"{part}_uri")
        if store.exists(used):
            with tempfile.NamedTemporaryFile(dir=tmp, delete=False) as copy:
                copy.write(store.read_bytes(used))
            same.append(_sha(copy.name) == _sha(uris[part]))
        else:
            same.append(False)
    report.add(
        "training data",
        all(same),
        "the files the trial trained on equal the re-split of the pinned snapshot"
        if all(same)
        else "data mismatch: split files that differ from the pinned snapshot's re-split: "
             f"{[p for p, s in zip(('train', 'val', 'test'), same) if not s]}",
    )
    return uris


def reproduce(
    ref: str, resources: dict[str, Any], strict: bool = False, pipeline: Optional[PipelineSpec] = None
) -> Report:
    """Rebuild `ref` and compare; `pipeline` defaults to the team definition named by its lineage."""
    registry: ModelRegistry = resources["registry"]
    store: ObjectStore = resources["store"]
    versioning: DataVersioning = resources["versioning"]
    name, number, alias = parse_ref(ref)
    version = registry.get_version(name, number) if number else registry.get_alias(name, alias or "")
    if version is None:
        raise ReproductionError(f"{ref}: model {name!r} has no alias {alias!r}")
    try:
        recorded_lineage = LineageRecord.from_tags(version.tags)
    except LineageError as e:
        raise ReproductionError(f"{ref}: version {version.version}: {e}") from e
    if recorded_lineage.checkpoint_uri is None:
        raise ReproductionError(
            f"{ref}: version {version.version} has no {CHECKPOINT_URI_TAG} tag; it was not registered by trainyard"
        )
    report = Report(name, version.version)
    trial_dir = recorded_lineage.checkpoint_uri.rstrip("/").rsplit("/", 2)[0]
    spec = TrainSpec.from_json(store.read_bytes(f"{trial_dir}/{SPEC_FILE}").decode())
    pipeline = split_as_recorded(
        pipeline or find_pipeline(recorded_lineage.pipeline), recorded_lineage.pipeline_fingerprint
    )

    _check_code_and_environment(ref, report, recorded_lineage, strict)

    # The recorded checkpoint is read as data (never unpickled as code); a tampered one stops here, before the retrain.
    # A LightGBM trial's checkpoint is its text model file: nothing in it runs.
    gbt = spec.task == "gbt"
    if not gbt:
        _verify(ref, f"{trial_dir}/checkpoints", "--check")

    with tempfile.TemporaryDirectory(prefix="trainyard-reproduce-") as tmp:
        uris = _restored_splits(store, versioning, pipeline, spec, recorded_lineage.data_version, tmp, report)

        # Retrain with the same spec on the restored data.
        out = naming.reproduction_dir(store, name, f"v{version.version}-{int(time.time())}")
        again = spec.model_copy(
            update={
                "output_uri": f"{out}/run",
                "data": spec.data.model_copy(update=uris),
                "tracker": TrackerSpec(kind="none"),
                "optuna": None,
            }
        )
        result = LocalLauncher().launch(again).result

    if gbt:
        report.add("model file", *_same_model_files(store, f"{trial_dir}/model", f"{again.output_uri}/model"))
    else:
        verdict = _verify(ref, f"{trial_dir}/checkpoints", f"{again.output_uri}/checkpoints")
        report.add("weights", verdict["identical"], verdict["detail"])
    for key, value in result.metrics.items():
        recorded_metric = recorded_lineage.metrics.get(key)
        if recorded_metric is not None:
            report.add(
                f"metric {key}", recorded_metric == value, f"recorded {recorded_metric:.6f}, rebuilt {value:.6f}"
            )
    report.report_uri = f"{out}/report.json"
    store.write_json(report.report_uri, report.to_dict())
    store.write_bytes(f"{out}/report.md", report.to_markdown().encode())
    return report
