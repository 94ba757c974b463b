"""`trainyard reproduce` and `trainyard compare` on a pipeline trained through Dagster."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from pipelines.reproduce import ReproductionError, parse_ref, reproduce
from trainyard import lineage
from trainyard.compare import DIFF_MARK, render, trial_rows, version_rows


def test_parse_ref() -> None:
    assert parse_ref("vision.digits@champion") == ("vision.digits", None, "champion")
    assert parse_ref("vision.digits@3") == ("vision.digits", "3", None)
    with pytest.raises(ReproductionError, match="must be '<model>@<version>' or '<model>@<alias>'"):
        parse_ref("vision.digits")


@pytest.mark.slow
def test_champion_rebuilds_bitwise(trained) -> None:
    harness, out = trained
    report = reproduce("test.digits@champion", harness.resources, pipeline=harness.spec)
    checks = {c.name: c for c in report.checks}
    assert checks["weights"].ok and "bitwise identical" in checks["weights"].detail
    assert checks["data version"].ok and checks["training data"].ok
    assert checks["metric test_acc"].ok
    assert report.reproduced
    assert harness.resources["store"].exists(report.report_uri)


@pytest.mark.slow
def test_changed_data_file_is_a_data_mismatch(trained, tmp_path: Path) -> None:
    harness, out = trained
    spec_json = harness.resources["store"].read_json(out["best"]["result_uri"].replace("result.json", "spec.json"))
    train_uri = spec_json["data"]["train_uri"]
    original = Path(train_uri).read_bytes()
    frame = pd.read_parquet(train_uri)
    frame.loc[0, frame.columns[0]] = 3.0
    frame.to_parquet(train_uri, index=False)
    try:
        report = reproduce("test.digits@champion", harness.resources, pipeline=harness.spec)
    finally:
        Path(train_uri).write_bytes(original)
    checks = {c.name: c for c in report.checks}
    assert (
        not checks["training data"].ok
        and "data mismatch" in checks["training data"].detail
        and "train" in checks["training data"].detail
    )
    assert not report.reproduced


def test_uncommitted_code_warns_or_fails_strict(trained, monkeypatch: pytest.MonkeyPatch) -> None:
    harness, _ = trained
    monkeypatch.setattr(lineage, "code_version", lambda: ("0" * 40, True))
    with pytest.raises(ReproductionError, match="code mismatch .* with uncommitted changes"):
        reproduce("test.digits@champion", harness.resources, strict=True, pipeline=harness.spec)


def test_compare_marks_differences(trained) -> None:
    harness, out = trained
    store = harness.resources["store"]
    results = [store.read_json(u) for u in store.glob(store.uri("runs", "test", "digits", "*", "*", "result.json"))]
    rows = trial_rows(results)
    assert [r["trial"] for r in sorted(rows, key=lambda r: r["trial"])] == ["trial-0000", "trial-0001"]
    md = render(rows, "markdown")
    header = md.splitlines()[0]
    assert f"{DIFF_MARK}params.lr" in header and f"{DIFF_MARK}data_version" not in header and "data_version" in header
    assert header.index("params.lr") < header.index("data_version")  # differences first
    csv_text = render(rows, "csv", only_differences=True)
    assert "data_version" not in csv_text.splitlines()[0]
    versions = version_rows(harness.resources["registry"], "test.digits")
    assert versions[0]["data_version"] == out["best"]["lineage"]["data_version"]


def test_wandb_offline_run_holds_the_lineage_record(trained) -> None:
    harness, out = trained
    runs = list((harness.home / "wandb").rglob("run-*.wandb"))
    assert len(runs) == 2  # one per trial
    record = out["best"]["lineage"]
    blob = b"".join(p.read_bytes() for p in runs)
    for value in (record["data_version"], record["lock_hash"], record["code_version"], "pipeline_fingerprint"):
        assert value.encode() in blob
