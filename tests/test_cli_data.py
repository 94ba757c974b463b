"""`trainyard data list|inspect|release|profile` on a local TRAINYARD_HOME."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from pipelines.cli import main
from resources.storage import ObjectStore
from trainyard import data as dq
from trainyard.data import ingest
from trainyard.spec import ColumnSpec, ModelSpec, PipelineSpec, SourceSpec


def make_spec(**over) -> PipelineSpec:
    fields = dict(
        team="vision",
        name="digits",
        source=SourceSpec(prefix="landing/vision/digits"),
        columns={
            "x": ColumnSpec(dtype="float", min=0, max=10),
            "s": ColumnSpec(dtype="str", domain=["a", "b"]),
            "label": ColumnSpec(dtype="int", domain=[0, 1]),
        },
        target="label",
        min_rows=4,
        model=ModelSpec(path="pipelines.vision.models:DigitsMLP"),
    )
    fields.update(over)
    return PipelineSpec(**fields)


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TRAINYARD_HOME", str(tmp_path))
    monkeypatch.delenv("TRAINYARD_ENV", raising=False)
    monkeypatch.setenv("TRAINYARD_USER", "ada")
    return tmp_path


@pytest.fixture
def store(home: Path) -> ObjectStore:
    return ObjectStore(root=str(home / "store"))


def good_rows(n: int = 20) -> str:
    return "x,s,label\n" + "".join(f"{i % 10},{'ab'[i % 2]},{(i // 2) % 2}\n" for i in range(n))


def rejected_version(store: ObjectStore) -> str:
    """Ingest landing data with an out-of-range value and let validation quarantine it; returns its md5."""
    spec = make_spec()
    store.write_bytes(store.uri("landing", "vision", "digits", "a.csv"), (good_rows() + "99,a,0\n").encode())
    snap = ingest.ingest(store, spec).snapshot
    outcome = dq.validate_version(store, spec, {"uri": snap.uri, "md5": snap.md5, "rows": snap.rows, "dvc_file": ""})
    assert not outcome.verdict.accepted
    return snap.md5


def test_list_is_empty_then_shows_every_kind(home, store, capsys) -> None:
    assert main(["data", "list"]) == 0
    assert capsys.readouterr().out == "nothing in quarantine\n"
    md5 = rejected_version(store)
    store.write_bytes(store.uri("landing", "vision", "digits", "b.csv"), b"x,label\n1,0\n")
    with pytest.raises(ingest.IngestRejected):
        ingest.ingest(store, make_spec())
    assert main(["data", "list", "vision/digits"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["pipeline", "id", "kind", "quarantined", "at", "released", "summary"]
    rows = [line.split()[:3] for line in lines[1:]]
    assert ["vision/digits", md5, "snapshot"] in rows and len(rows) == 2
    assert any(r[2] == "file" for r in rows)
    assert main(["data", "list", "--json"]) == 0
    entries = json.loads(capsys.readouterr().out)
    assert {e["kind"] for e in entries} == {"snapshot", "file"}
    assert main(["data", "list", "digits"]) == 2
    assert "must be '<team>/<name>'" in capsys.readouterr().err


def test_inspect_shows_failing_expectations_with_rows(home, store, capsys) -> None:
    md5 = rejected_version(store)
    assert main(["data", "inspect", "vision/digits", md5]) == 0
    out = capsys.readouterr().out
    assert f"vision/digits {md5}: snapshot" in out
    assert "expect_column_values_to_be_between [x]: unexpected 1, e.g. [99.0]" in out
    assert 'row 20: {"_row": 20, "x": 99.0}' in out
    assert "data docs  : " in out and "released   : no" in out
    assert main(["data", "inspect", "vision/digits", md5, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["md5"] == md5
    assert main(["data", "inspect", "vision/digits", "f" * 32]) == 2
    assert (
        f"no quarantine entry '{'f' * 32}' for pipeline 'vision/digits'; entries: ['{md5}']" in capsys.readouterr().err
    )


def test_release_needs_a_reason_and_records_who_when_why(home, store, capsys) -> None:
    md5 = rejected_version(store)
    with pytest.raises(SystemExit) as info:
        main(["data", "release", "vision/digits", md5])
    assert info.value.code == 2
    assert "the following arguments are required: --reason" in capsys.readouterr().err
    assert main(["data", "release", "vision/digits", md5, "--reason", "   "]) == 2
    assert "release needs a reason" in capsys.readouterr().err

    assert main(["data", "release", "vision/digits", md5, "--reason", "value 99 confirmed by the owner"]) == 0
    assert f"released vision/digits {md5} by ada at " in capsys.readouterr().out
    record = json.loads((home / "store" / "quarantine" / "vision" / "digits" / md5 / "release.json").read_text())
    assert record["released_by"] == "ada" and record["reason"] == "value 99 confirmed by the owner"
    assert record["released_at"].endswith("+00:00")
    assert main(["data", "release", "vision/digits", md5, "--reason", "again", "--by", "bob"]) == 2
    assert "already released by ada" in capsys.readouterr().err

    main(["data", "list"])
    assert "yes" in capsys.readouterr().out.splitlines()[1].split()
    # the release is honoured by the next validation of that version
    raw = {
        "uri": store.uri("data", "vision", "digits", "raw", md5, "data.parquet"),
        "md5": md5,
        "rows": 21,
        "dvc_file": "",
    }
    assert dq.validate_version(store, make_spec(), raw).verdict.accepted


def test_profile_writes_an_editable_suite_that_passes_its_snapshot(home, store, tmp_path, capsys) -> None:
    assert main(["data", "profile", "vision/digits"]) == 2
    assert "has no snapshot yet" in capsys.readouterr().err
    store.write_bytes(store.uri("landing", "vision", "digits", "a.csv"), good_rows().encode())
    snap = ingest.ingest(store, make_spec()).snapshot
    out = tmp_path / "suites" / "digits.json"
    assert main(["data", "profile", "vision/digits", "--out", str(out), "--range-margin", "0.1"]) == 0
    assert f"wrote 12 expectations for 20 rows of {snap.uri}" in capsys.readouterr().err
    suite = json.loads(out.read_text())
    assert suite["name"] == "vision/digits" and suite["meta"]["snapshot"] == snap.uri
    by = {(e["type"], e["kwargs"].get("column")): e["kwargs"] for e in suite["expectations"]}
    assert by[("expect_column_values_to_be_between", "x")] == {"column": "x", "min_value": -0.9, "max_value": 9.9}
    assert by[("expect_column_values_to_be_in_set", "s")]["value_set"] == ["a", "b"]
    spec = make_spec(suite=str(out))
    frame = pd.read_parquet(snap.uri)
    assert dq.validate(frame, spec).success
    assert main(["data", "profile", "vision/digits", "--md5", snap.md5, "--range-margin", "0.1"]) == 0
    assert json.loads(capsys.readouterr().out)["expectations"] == suite["expectations"]
    assert main(["data", "profile", "vision/digits", "--md5", "0" * 32]) == 2
    assert "no snapshot" in capsys.readouterr().err
    assert main(["data", "profile", "vision/digits", "--row-margin", "1.5"]) == 2
