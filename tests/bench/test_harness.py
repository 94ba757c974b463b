"""`make bench`'s runner and harness (targets, table, exit code, recorded fields) and the peak-memory probe."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from bench import __main__ as runner
from bench.harness import RESULTS_ENV, Target, evaluate_target, peak_rss_bytes, write_result

ROOT = Path(__file__).resolve().parents[2]

MEETS = """
import os, statistics
from bench.harness import Target, write_result
RUNS = [0.9, 1.3, 1.0, 0.95, 1.1]
def main():
    print('chatter on stdout')
    return write_result("fake_meets", statistics.median(RUNS), "s", 2.0, {"extra": 4, "pid": os.getpid()},
                        targets=[Target("ratio", "<=", 0.6), Target("details.extra", ">=", 3, unit="widgets")],
                        better="lower", runs=RUNS, baseline_runs=[2.0, 2.2, 1.9])
"""

MISSES = """
from bench.harness import Target, write_result
def main():
    # a target evaluated by the benchmark itself, as cluster_sim writes them; its "met" is wrong on purpose
    own = {"metric": "utilization", "op": ">=", "threshold": 0.9, "value": 0.8, "met": True}
    return write_result("fake_misses", 10.0, "samples/s", 20.0, {"targets": [own]},
                        targets=[Target("ratio", ">=", 0.98)], better="higher")
"""

ARGPARSE = """
import argparse
from bench.harness import Target, write_result
def main(argv=None):
    args = argparse.ArgumentParser()
    args.add_argument("--size", type=int, default=3)
    size = args.parse_args(argv).size
    return write_result("fake_argparse", float(size), "s", None, {}, targets=[Target("value", "<=", 5)], better="lower")
"""

UNDECLARED = """
from bench.harness import write_result
def main():
    return write_result("fake_undeclared", 1.0, "s", None, {})
"""


@pytest.fixture
def fakes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    modules = tmp_path / "modules"
    modules.mkdir()
    for name, text in {
        "bench_meets": MEETS,
        "bench_misses": MISSES,
        "bench_undeclared": UNDECLARED,
        "bench_argparse": ARGPARSE,
        "bench_broken": "def main():\n    raise RuntimeError('broken benchmark')\n",
    }.items():
        (modules / f"{name}.py").write_text(text)
    results = tmp_path / "results"
    monkeypatch.setenv("PYTHONPATH", str(modules))
    monkeypatch.setenv(RESULTS_ENV, str(results))
    return results


def _table(out: str) -> list[list[str]]:
    """The rows of the table the runner printed last (header and rule excluded)."""
    lines = out.splitlines()
    start = max(i for i, line in enumerate(lines) if line.split()[:1] == ["benchmark"])
    return [line.split() for line in lines[start + 2 :] if line.strip()]


def test_a_missed_target_fails_the_run_and_the_table_says_which(fakes: Path, capsys: pytest.CaptureFixture) -> None:
    before = datetime.now(UTC) - timedelta(seconds=1)
    assert runner.main(["bench_meets", "bench_misses"]) == 1
    captured = capsys.readouterr()
    rows = _table(captured.out)
    assert rows == [
        ["fake_meets", "0.5", "x", "ratio", "<=", "0.6", "yes"],
        ["fake_meets", "4", "widgets", "details.extra", ">=", "3", "yes"],
        [
            "fake_misses",
            "0.8",
            "utilization",
            ">=",
            "0.9",
            "no",
        ],  # no unit; the benchmark's own "met: true" is not trusted
        ["fake_misses", "0.5", "x", "ratio", ">=", "0.98", "no"],
    ]
    assert "targets missed or not declared: fake_misses" in captured.err

    record = json.loads((fakes / "fake_meets.json").read_text())
    assert {"name", "value", "unit", "baseline", "ratio", "details"} <= set(record)
    assert record["value"] == 1.0 and record["ratio"] == 0.5  # the median of the runs, over the baseline
    d, p, r = record["details"], record["details"]["provenance"], record["details"]["repeats"]
    sha = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    dirty = bool(
        subprocess.run(
            ["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    )
    assert p["commit"] == sha and p["dirty"] is dirty
    started, finished = datetime.fromisoformat(p["started_utc"]), datetime.fromisoformat(p["finished_utc"])
    assert before <= started <= finished <= datetime.now(UTC)
    for when in ("before", "after"):
        assert len(p["load_average"][when]) == 3 and all(x >= 0 for x in p["load_average"][when])
    assert r["count"] == 5 and r["spread"] == {"min": 0.9, "median": 1.0, "max": 1.3}
    assert r["baseline_spread"] == {"min": 1.9, "median": 2.0, "max": 2.2}
    assert d["better"] == "lower" and r["aggregate"] == "median"
    assert d["pid"] != os.getpid()  # it ran in a process of its own

    missed = json.loads((fakes / "fake_misses.json").read_text())["details"]
    assert missed["repeats"]["count"] == 1 and missed["repeats"]["spread"] == {"min": 10.0, "median": 10.0, "max": 10.0}
    assert [(t["metric"], t["met"]) for t in missed["targets"]] == [("utilization", False), ("ratio", False)]


def test_every_target_met_exits_zero(fakes: Path, capsys: pytest.CaptureFixture) -> None:
    assert runner.main(["bench_meets"]) == 0
    out = capsys.readouterr().out
    first = json.loads(out.splitlines()[0])
    assert first["name"] == "fake_meets" and first["better"] == "lower" and all(t["met"] for t in first["targets"])
    assert [row[-1] for row in _table(out)] == ["yes", "yes"]


def test_failed_and_undeclared_benchmarks_fail_the_run_and_the_rest_still_run(
    fakes: Path, capfd: pytest.CaptureFixture
) -> None:
    assert runner.main(["bench_broken", "bench_undeclared", "bench_meets"]) == 1
    captured = capfd.readouterr()  # the benchmark's own traceback goes to the shared stderr
    rows = _table(captured.out)
    assert rows[0] == ["bench_broken", "-", "-", "benchmark", "failed", "no"]
    assert rows[1] == ["fake_undeclared", "1", "s", "no", "target", "declared", "no"]
    assert [r[-1] for r in rows[2:]] == ["yes", "yes"]
    assert "broken benchmark" in captured.err and "failed: bench_broken" in captured.err
    assert "targets missed or not declared: fake_undeclared\n" in captured.err


def test_write_result_refuses_what_would_mislead(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(RESULTS_ENV, str(tmp_path))
    with pytest.raises(ValueError, match="not the median"):
        write_result("x", 3.0, "s", None, {}, runs=[1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="better must be"):
        write_result("x", 1.0, "s", None, {}, better="faster")
    with pytest.raises(ValueError, match="written by the harness"):
        write_result("x", 1.0, "s", None, {"provenance": "mine"})
    with pytest.raises(ValueError, match="op must be"):
        Target("value", "<", 1.0)
    with pytest.raises(ValueError, match="op must be"):
        write_result("x", 1.0, "s", None, {"targets": [{"metric": "m", "op": "==", "threshold": 1, "value": 1}]})
    best = write_result("x", 3.0, "s", 2.0, {}, runs=[1.0, 2.0, 3.0], aggregate="best of the runs")
    assert best["details"]["repeats"]["aggregate"] == "best of the runs" and best["ratio"] == 1.5
    assert json.loads((tmp_path / "x.json").read_text())["value"] == 3.0


def test_a_benchmark_with_command_line_options_runs_on_its_defaults(fakes: Path) -> None:
    # `python -m bench` runs each module through `python -c`; the module's own argparse must see no arguments.
    result = runner.run_one("bench_argparse")
    assert result is not None and result["value"] == 3.0


def test_a_target_without_a_finite_value_is_missed() -> None:
    record = {"name": "x", "value": float("nan"), "ratio": None, "details": {"a": {"b": 2}}}
    assert not evaluate_target({"metric": "value", "op": "<=", "threshold": 1}, record)["met"]
    assert not evaluate_target({"metric": "ratio", "op": ">=", "threshold": 0}, record)["met"]
    assert not evaluate_target({"metric": "details.a.c", "op": ">=", "threshold": 0}, record)["met"]
    assert evaluate_target({"metric": "details.a.b", "op": ">=", "threshold": 2}, record) == \
        {"metric": "details.a.b", "op": ">=", "threshold": 2, "value": 2, "met": True, "better": "higher"}


def test_a_child_of_a_large_process_reports_its_own_peak() -> None:
    ballast = bytearray(400 * 2**20)
    for i in range(0, len(ballast), 4096):
        ballast[i] = 1  # touch every page: 400 MiB resident in this process
    code = "import resource, json; from bench.harness import peak_rss_bytes; " \
           "print(json.dumps([peak_rss_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024]))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    own, inherited = json.loads(out)
    assert own < 150 * 2**20  # an interpreter, not its parent's 400 MiB
    assert inherited >= 400 * 2**20  # what ru_maxrss says on Linux: the parent's high-water mark
    assert peak_rss_bytes() >= 400 * 2**20
    del ballast
