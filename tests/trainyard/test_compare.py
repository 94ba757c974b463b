"""`trainyard compare`: whole values on demand, and a study column that tells apart trials with the same label."""

from __future__ import annotations

from trainyard.compare import CUT_MARK, DIFF_MARK, render, study_of_result, trial_rows

LONG = "s3://lake/churn/exports/2026-11/customers-part-0003-of-0004.parquet"  # 66 characters


def result(trial: str, acc: float, source: str = LONG) -> dict:
    return {"trial_id": trial, "metrics": {"test_acc": acc}, "lineage": {"source": source}, "epochs": 1,
            "samples_per_second": 10.0, "device_hours": 0.001}


def rows() -> list[dict]:
    uris = ["/home/runs/crm/churn/crm.churn.aaaaaaaaaaaa.f1/trial-0000/result.json",
            "/home/runs/crm/churn/crm.churn.bbbbbbbbbbbb.f2/trial-0000/result.json"]
    return trial_rows([result("trial-0000", 0.9), result("trial-0000", 0.8)], [study_of_result(u) for u in uris])


def test_trials_of_two_studies_with_the_same_label_are_told_apart() -> None:
    assert (
        study_of_result("s3://b/runs/crm/churn/crm.churn.aaaaaaaaaaaa.f1/trial-0003/result.json")
        == "crm.churn.aaaaaaaaaaaa.f1"
    )
    table = rows()
    assert [(r["trial"], r["study"]) for r in table] == [
        ("trial-0000", "crm.churn.aaaaaaaaaaaa.f1"),
        ("trial-0000", "crm.churn.bbbbbbbbbbbb.f2"),
    ]
    md = render(table, "markdown")
    header = md.splitlines()[0]
    assert header.startswith(
        f"| trial | {DIFF_MARK}study | {DIFF_MARK}metric.test_acc |"
    )  # the row's name first, then the differences
    assert "crm.churn.aaaaaaaaaaaa.f1" in md and "crm.churn.bbbbbbbbbbbb.f2" in md
    only = render(table, "csv", only_differences=True).splitlines()[0]
    assert only == f"trial,{DIFF_MARK}study,{DIFF_MARK}metric.test_acc"


def test_values_are_whole_in_markdown_csv_and_the_wide_table_and_marked_when_cut() -> None:
    table = rows()
    assert LONG in render(table, "markdown") and LONG in render(table, "csv")
    cut = render(table, "table")
    assert LONG not in cut and LONG[:39] + CUT_MARK in cut
    assert cut.splitlines()[-1].startswith("(values longer than 40 characters are cut with …; --wide")
    wide = render(table, "table", wide=True)
    assert LONG in wide and CUT_MARK not in wide
    study_line = next(line for line in wide.splitlines() if line.startswith(f"{DIFF_MARK}study"))
    assert "crm.churn.aaaaaaaaaaaa.f1" in study_line and "crm.churn.bbbbbbbbbbbb.f2" in study_line
