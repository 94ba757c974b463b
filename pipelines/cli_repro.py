"""`trainyard compare` and `trainyard reproduce`.

`trainyard --help` imports this module to build its parser; the environment's
resources, the core and the reproduction (Dagster, MLflow, pandas, pydantic)
are imported inside the commands.
"""

from __future__ import annotations

import argparse
import json
from typing import Any


def _resources() -> dict[str, Any]:
    from pipelines.environments import resources_for  # lazy: loads every resource

    return resources_for()


def cmd_compare(args: argparse.Namespace) -> int:
    """`trainyard compare`: registered versions of a model, or the trials of a pipeline, side by side."""
    from trainyard import naming  # lazy: pydantic
    from trainyard.compare import render, study_of_result, trial_rows, version_rows  # lazy: pydantic

    res = _resources()
    if args.trials:
        store = res["store"]
        team, _, name = args.target.partition("/")
        if not name:
            print(f"--trials takes a pipeline key like 'vision/digits', got {args.target!r}")
            return 2
        uris = store.glob(naming.trial_results_glob(store, team, name))
        rows = trial_rows([store.read_json(u) for u in uris], [study_of_result(u) for u in uris])
    else:
        rows = version_rows(res["registry"], args.target, args.versions.split(",") if args.versions else None)
    print(render(rows, args.format, only_differences=args.differences, wide=args.wide))
    return 0


def cmd_reproduce(args: argparse.Namespace) -> int:
    """`trainyard reproduce`: rebuild a registered model and report whether it is the same."""
    from pipelines.reproduce import ReproductionError, reproduce  # lazy: the launcher, DVC and pandas

    try:
        report = reproduce(args.ref, _resources(), strict=args.strict)
    except ReproductionError as e:
        print(f"not reproduced: {e}")
        return 1
    print(report.to_markdown())
    print(f"\nreport: {report.report_uri}")
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    return 0 if report.reproduced else 1


def register(sub: Any) -> None:
    """Adds `compare` and `reproduce` to the `trainyard` parser."""
    compare = sub.add_parser("compare", help="compare registered versions of a model, or the trials of a pipeline")
    compare.add_argument("target", help="a registered model name (e.g. vision.digits), or a pipeline key with --trials")
    compare.add_argument(
        "--trials", action="store_true", help="compare the trials of pipeline TARGET (e.g. vision/digits)"
    )
    compare.add_argument("--versions", help="comma-separated versions to compare (default: all)")
    compare.add_argument("--format", choices=("table", "markdown", "csv"), default="table")
    compare.add_argument("--differences", action="store_true", help="show only the fields that differ")
    compare.add_argument(
        "--wide", action="store_true", help="whole values in the terminal table (cut at 40 characters otherwise)"
    )
    compare.set_defaults(func=cmd_compare)
    repro = sub.add_parser("reproduce", help="rebuild a registered model from its lineage and compare weights")
    repro.add_argument("ref", help="<model>@<version|alias>, e.g. vision.digits@champion")
    repro.add_argument(
        "--strict", action="store_true", help="abort when the code or lock differs from the recorded one"
    )
    repro.add_argument("--json", action="store_true", help="also print the report as JSON")
    repro.set_defaults(func=cmd_reproduce)
