"""`trainyard data`: the quarantine, releases, and suites generated from a trusted snapshot.

    trainyard data list                                   # every quarantined version, file and set-aside rows
    trainyard data list vision/digits
    trainyard data inspect vision/digits 3f2a...          # report: failing expectations, sample rows, drift
    trainyard data release vision/digits 3f2a... --reason "outliers checked with the data owner, TICKET-12"
    trainyard data profile vision/digits --out pipelines/vision/digits_suite.json

`release` records who (`--by`, default `$TRAINYARD_USER` or the login name),
when and why next to the quarantined data, which stays where it is; the next
`prepare` run lets that version through. `profile` writes a Great
Expectations suite describing a snapshot (default: the latest) to review,
edit and name in `PipelineSpec(suite=...)`. The object store is the
environment's (`TRAINYARD_ENV`, default `local` under `TRAINYARD_HOME`).

Exit status: 0 done, 2 bad input (unknown pipeline, entry or version; no
reason), 3 the object store failed.
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import sys
from typing import Any, Optional

EXIT_BAD_INPUT = 2
EXIT_STORAGE = 3


def register(subparsers: Any) -> None:
    """Adds `data` and its subcommands to the `trainyard` parser."""
    parser = subparsers.add_parser("data", help="inspect and release quarantined data; generate suites from a snapshot")
    sub = parser.add_subparsers(dest="data_command", required=True)

    ls = sub.add_parser("list", help="quarantined versions, rejected files and set-aside rows")
    ls.add_argument("pipeline", nargs="?", help="team/pipeline, e.g. vision/digits (default: all)")
    ls.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ls.set_defaults(func=cmd_list)

    inspect = sub.add_parser("inspect", help="the report of one quarantine entry")
    inspect.add_argument("pipeline", help="team/pipeline, e.g. vision/digits")
    inspect.add_argument("id", help="data version (md5) or rejected file id, as `data list` shows")
    inspect.add_argument("--json", action="store_true", help="print the whole report as JSON")
    inspect.set_defaults(func=cmd_inspect)

    release = sub.add_parser("release", help="let a quarantined version through (recorded: who, when, why)")
    release.add_argument("pipeline", help="team/pipeline, e.g. vision/digits")
    release.add_argument("md5", help="the quarantined data version")
    release.add_argument("--reason", required=True, help="why this data may be used (recorded)")
    release.add_argument("--by", default=None, help="who releases it (default: $TRAINYARD_USER or the login name)")
    release.set_defaults(func=cmd_release)

    profile = sub.add_parser("profile", help="write a Great Expectations suite describing a trusted snapshot")
    profile.add_argument("pipeline", help="team/pipeline, e.g. vision/digits")
    profile.add_argument("--md5", default=None, help="the snapshot's data version (default: the latest)")
    profile.add_argument("--out", default=None, help="file to write the suite to (default: print it)")
    profile.add_argument(
        "--row-margin", type=float, default=0.5, help="allowed relative change of the row count (default 0.5)"
    )
    profile.add_argument(
        "--range-margin",
        type=float,
        default=0.0,
        help="share of each numeric range's width added on both sides (default 0)",
    )
    profile.set_defaults(func=cmd_profile)


def _store() -> Any:
    from pipelines.environments import (
        resources_for,
    )  # lazy: pandas/Dagster load per command, keeping `trainyard --help` fast

    return resources_for()["store"]


def _fail(message: str, code: int = EXIT_BAD_INPUT) -> int:
    print(f"trainyard data: {message}", file=sys.stderr)
    return code


def _split_pipeline(pipeline: str) -> Optional[tuple[str, str]]:
    team, _, name = pipeline.partition("/")
    return (team, name) if team and name and "/" not in name else None


def _guard(fn: Any) -> Any:
    """Turn the data and storage error hierarchies into exit codes with their message."""

    def run(args: argparse.Namespace) -> int:
        from resources.storage import (
            StorageError,
        )  # lazy: pandas/Dagster load per command, keeping `trainyard --help` fast
        from trainyard.data import (
            DataQualityError,
        )  # lazy: pandas/Dagster load per command, keeping `trainyard --help` fast

        try:
            return fn(args)
        except DataQualityError as e:
            return _fail(str(e))
        except StorageError as e:
            return _fail(str(e), EXIT_STORAGE)

    return run


@_guard
def cmd_list(args: argparse.Namespace) -> int:
    from trainyard.data import list_quarantine  # lazy: pandas/Dagster load per command, keeping `trainyard --help` fast

    if args.pipeline and _split_pipeline(args.pipeline) is None:
        return _fail(f"pipeline {args.pipeline!r} must be '<team>/<name>', e.g. 'vision/digits'")
    entries = list_quarantine(_store(), args.pipeline)
    if args.json:
        print(json.dumps([e.__dict__ for e in entries], indent=2, sort_keys=True))
        return 0
    if not entries:
        print("nothing in quarantine" + (f" for {args.pipeline}" if args.pipeline else ""))
        return 0
    print(f"{'pipeline':<20} {'id':<34} {'kind':<9} {'quarantined at':<26} {'released':<10} summary")
    for e in entries:
        released = "yes" if e.released else ("resolved" if e.resolved else "no")
        summary = e.summary if len(e.summary) <= 100 else e.summary[:99] + "…"
        print(f"{e.pipeline:<20} {e.id:<34} {e.kind:<9} {e.quarantined_at:<26} {released:<10} {summary}")
    return 0


@_guard
def cmd_inspect(args: argparse.Namespace) -> int:
    from trainyard.data import read_quarantine  # lazy: pandas/Dagster load per command, keeping `trainyard --help` fast

    report = read_quarantine(_store(), args.pipeline, args.id)
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True, default=str))
        return 0
    print(
        f"{report.get('pipeline')} {args.id}: {report.get('kind', 'snapshot')}, quarantined at "
        f"{report.get('quarantined_at')}"
    )
    print(f"  where      : {report['uri']}")
    if report.get("data"):
        print(f"  data       : {report['data']}")
    if report.get("copy"):
        print(f"  file copy  : {report['copy']}")
    if report.get("file"):
        print(f"  landing    : {report['file']} ({report.get('size')} bytes)")
    if report.get("data_docs"):
        print(f"  data docs  : {report['data_docs']}")
    if report.get("policy"):
        print(f"  policy     : on_bad_data={report['policy']!r}")
    release = report.get("release")
    released = f"by {release['released_by']} at {release['released_at']}: {release['reason']}" if release else "no"
    print(f"  released   : {released}")
    if report.get("resolved"):
        print(f"  resolved   : {report['resolved']['how']} at {report['resolved']['at']}")
    if report.get("superseded"):
        print(f"  supersedes : {len(report['superseded'])} earlier round(s) of this file")
    reasons = report.get("reasons") or []
    if reasons:
        print("reasons:")
        for reason in reasons:
            print(f"  - {reason}")
    validation = report.get("validation") or {}
    failures = [r for r in validation.get("results", []) if not r["success"]]
    if failures:
        print(f"failing expectations ({len(failures)} of {validation.get('evaluated')}):")
        for r in failures:
            where = f" [{r['column']}]" if r.get("column") else ""
            detail = r.get("exception") or f"unexpected {r.get('unexpected_count')}, e.g. {r.get('unexpected_values')}"
            print(f"  - {r['expectation']}{where}: {detail}")
            for row in (r.get("sample_rows") or [])[:5]:
                shown = {k: v for k, v in row.items() if k in ("_row", r.get("column")) or r.get("column") is None}
                print(f"      row {row.get('_row')}: {json.dumps(shown if len(shown) > 1 else row, default=str)[:200]}")
    drifted = [d for d in report.get("drift") or [] if d.get("drifted")]
    if drifted:
        print("drift above threshold:")
        for d in drifted:
            print(f"  - {d['column']}: PSI {d.get('psi')}, KS {d.get('ks')}")
    return 0


@_guard
def cmd_release(args: argparse.Namespace) -> int:
    from common.settings import settings
    from trainyard.data import (
        release_quarantine,
    )  # lazy: pandas/Dagster load per command, keeping `trainyard --help` fast

    by = args.by or settings().user or getpass.getuser()
    record = release_quarantine(_store(), args.pipeline, args.md5, args.reason, by)
    print(
        f"released {record['pipeline']} {record['md5']} by {record['released_by']} at {record['released_at']}: "
        f"{record['reason']}"
    )
    print("the next prepare run lets this version through; its data stays in quarantine")
    return 0


@_guard
def cmd_profile(args: argparse.Namespace) -> int:
    from trainyard import naming  # lazy: pandas/Dagster load per command, keeping `trainyard --help` fast
    from trainyard.data import profile_snapshot, profile_to_suite  # lazy: as above

    parts = _split_pipeline(args.pipeline)
    if parts is None:
        return _fail(f"pipeline {args.pipeline!r} must be '<team>/<name>', e.g. 'vision/digits'")
    if not 0 <= args.row_margin < 1:
        return _fail(f"--row-margin {args.row_margin} must be in [0, 1)")
    if args.range_margin < 0:
        return _fail(f"--range-margin {args.range_margin} must be >= 0")
    store = _store()
    team, name = parts
    if args.md5:
        uri = f"{naming.raw_dir(store, team, name, args.md5)}/data.parquet"
        if not store.exists(uri):
            return _fail(f"no snapshot {args.md5!r} of {args.pipeline} (looked for {uri})")
    else:
        manifest = naming.ingest_manifest(store, team, name)
        snapshot = store.read_json(manifest).get("snapshot") if store.exists(manifest) else None
        if not snapshot:
            return _fail(f"{args.pipeline} has no snapshot yet (no {manifest}); run its prepare job first")
        uri = snapshot["uri"]
    profile, _ = profile_snapshot(store, uri)
    suite = profile_to_suite(profile, args.pipeline, row_margin=args.row_margin, range_margin=args.range_margin)
    suite["meta"]["snapshot"] = uri
    text = json.dumps(suite, indent=2) + "\n"
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)
        print(
            f"wrote {len(suite['expectations'])} expectations for {profile['rows']} rows of {uri} to {args.out}",
            file=sys.stderr,
        )
    else:
        sys.stdout.write(text)
    return 0
