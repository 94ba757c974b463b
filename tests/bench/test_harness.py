"""`make bench`'s runner and the peak-memory probe the memory benchmarks use."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import __main__ as runner
from bench.harness import peak_rss_bytes

ROOT = Path(__file__).resolve().parents[2]


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


def test_each_benchmark_runs_in_its_own_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "bench_ok.py").write_text(
        "import os\n"
        "def main():\n"
        "    print('chatter on stdout')\n"
        "    return {'name': 'ok', 'value': os.getpid(), 'unit': 'pid', 'baseline': None, 'ratio': None, 'details': {}}\n"
    )
    (tmp_path / "bench_broken.py").write_text("def main():\n    raise RuntimeError('broken benchmark')\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    assert runner.main(["bench_ok", "bench_ok"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["name"] for r in lines] == ["ok", "ok"]
    assert len({r["value"] for r in lines} | {os.getpid()}) == 3  # two fresh processes, neither this one
    assert runner.main(["bench_broken", "bench_ok"]) == 1  # a failure is reported and the rest still run
    captured = capsys.readouterr()
    assert '"failed"' in captured.out and '"name": "ok"' in captured.out and "bench_broken" in captured.err
