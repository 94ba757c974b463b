"""Validation of one shard version: every shard's checksum and decoding, per-document bounds, a table per shard, drift.

`validate_shard_version` reads each split of a version (`trainyard.data.shards`)
once, one shard (litdata chunk) at a time, and finds every problem of the
delivery, each named by landing file and line:

- a shard whose sha256 differs from the one recorded when it was written
  (`meta.json`), or that is missing, or whose layout does not parse: the
  shard was altered in the store; the version is marked damaged so the next
  ingest writes it again from the landing files;
- a split litdata cannot read (`training.shard_format.open_split`, every sample);
- text: a token id outside the vocabulary (`TextShards.vocabulary`), a
  document not ending with the end-of-document id; documents shorter than
  `min_tokens` (empty), longer than `max_tokens`, or repeating an earlier
  document (by content), beyond `max_empty_rate`, `max_long_rate`,
  `max_duplicate_rate`;
- images: a shape, dtype or value range other than declared, a label outside
  the declared ones, repeated images beyond `max_duplicate_rate`;
- fewer items than `spec.min_rows`, or a split without any.

Per-shard statistics (items, tokens, mean and max document length, empty,
long, duplicates, out-of-vocabulary ids; per-image mean/std/min/max for
images) form a table that a Great Expectations suite judges
(`trainyard.data.expectations.ArrowSuite`: checksums, decoding, no
out-of-vocabulary id, image shape/dtype/range); the rates are platform checks
over the whole delivery. Drift: the unigram distribution of the new
delivery's documents (the files the previous accepted version did not have;
the whole version when none is new) against the previous accepted version, as
a PSI over frequency buckets of that version's tokens; for images the PSI of
per-image mean brightness and of the labels. The verdict is
`trainyard.data.validation.decide`'s: `max_drift_psi`, `on_drift`, and
`trainyard data release` as for tables. `on_bad_data="warn"` acts on landing
files at ingest; a shard version with problems is rejected whatever the policy
(its shards are immutable), and kept in quarantine with its report.

Reading the shards and tallying them is `trainyard.data.shard_reading`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import numpy as np
import pyarrow as pa

from training import shard_format
from trainyard import naming
from trainyard.data.drift_detection import PSI_EPSILON
from trainyard.data.expectations import ArrowSuite
from trainyard.data.quarantine import release_of, utc_now
from trainyard.data.report import PLATFORM_CHECK, ValidationReport, md_cell, result_from_ge
from trainyard.data.shard_reading import Problems, Tally, read_version, where
from trainyard.data.shards import DAMAGED, store_relative
from trainyard.data.validation import Verdict, decide
from trainyard.shardspec import ImageShards, TextShards
from trainyard.spec import PipelineSpec
from trainyard.store import FileStore

DRIFT_BUCKETS = 20
"""Frequency buckets of the reference's tokens the unigram PSI is measured over (equal shares of its tokens)."""
DRIFT_MIN_TOKENS = 2000
"""Fewest tokens a delivery needs for its unigram PSI to be judged (measured and shown below it, never called
drifted)."""
DRIFT_MIN_IMAGES = 200
"""Fewest images a delivery needs for its pixel drift to be judged."""
PIXEL_BINS = 10


@dataclasses.dataclass
class ShardVersionOutcome:
    """What `validate_shard_version` found and did.

    Attributes:
        verdict: The decision (`trainyard.data.validation.Verdict`).
        report: The suite's and platform checks' results.
        problems: Every problem, one line each naming file and line (first `shard_reading.MAX_PROBLEMS_KEPT`).
        problem_count: How many problems in all.
        shards: The per-shard statistics table, one dict per shard.
        drift: Drift rows (as `trainyard.data.drift_detection` makes them; empty for the first version).
        quarantine: Where the rejected version's report is kept (None when accepted).
        value: When accepted: `ValidatedData`'s fields.
    """

    verdict: Verdict
    report: ValidationReport
    problems: list[str]
    problem_count: int
    shards: list[dict[str, Any]]
    drift: list[dict[str, Any]]
    quarantine: Optional[str]
    value: Optional[dict[str, Any]]


# --------------------------------------------------------------------------- checks


def _duplicates(tally: Tally, limit: float, problems: Problems) -> list[dict[str, Any]]:
    """Mark repeated items (all but the first of each content) in the shard rows; their lines are problems beyond
    `limit`."""
    if not tally.hashes:
        return []
    hashes = np.concatenate(tally.hashes)
    _, first = np.unique(hashes, return_index=True)
    repeated = np.setdiff1d(np.arange(len(hashes)), first)
    for i in repeated:
        tally.shards[tally.shard_of[i]]["duplicates"] += 1
    rate = len(repeated) / max(len(hashes), 1)
    if rate > limit:
        for i in repeated:
            split, file, record = tally.places[i]
            problems.add(f"{where(file, record)}: repeats an earlier item ({split} split)")
    return [
        _platform(
            "trainyard_duplicate_rate",
            rate,
            limit,
            len(repeated),
            [where(tally.places[i][1], tally.places[i][2]) for i in repeated[:5]],
        )
    ]


def _platform(
    name: str, observed: float, limit: float, count: int, samples: Sequence[str], success: Optional[bool] = None
) -> dict[str, Any]:
    return {
        "expectation": name,
        "column": None,
        "kwargs": {"max_value": limit},
        "success": observed <= limit if success is None else success,
        "observed_value": round(observed, 6),
        "unexpected_count": count,
        "unexpected_values": list(samples)[:5],
        "unexpected_index_list": [],
        "exception": None,
        "source": PLATFORM_CHECK,
        "row_level": False,
        "sample_rows": [],
    }


def _rate_check(name: str, lines: list[str], items: int, limit: float, problems: Problems) -> dict[str, Any]:
    rate = len(lines) / max(items, 1)
    if rate > limit:
        for line in lines:
            problems.add(line)
    return _platform(name, rate, limit, len(lines), [line.split(": ", 1)[0] for line in lines])


def suite_for(spec: PipelineSpec) -> list[dict[str, Any]]:
    """The Great Expectations suite of the per-shard table."""
    out: list[dict[str, Any]] = [
        {"type": "expect_table_row_count_to_be_between", "kwargs": {"min_value": 1}},
        {"type": "expect_column_values_to_be_in_set", "kwargs": {"column": "checksum_ok", "value_set": [True]}},
        {"type": "expect_column_values_to_be_in_set", "kwargs": {"column": "decodes", "value_set": [True]}},
    ]
    zero = (
        ["out_of_vocab"]
        if isinstance(spec.shards, TextShards)
        else ["bad_shape", "bad_dtype", "out_of_range", "bad_label"]
    )
    out += [
        {"type": "expect_column_values_to_be_between", "kwargs": {"column": c, "min_value": 0, "max_value": 0}}
        for c in zero
    ]
    if isinstance(spec.shards, ImageShards):
        out += [{"type": "expect_column_min_to_be_between", "kwargs": {"column": "min", "min_value": spec.shards.min}},
                {"type": "expect_column_max_to_be_between", "kwargs": {"column": "max", "max_value": spec.shards.max}}]
    return out


def _report(spec: PipelineSpec, tally: Tally, platform: list[dict[str, Any]]) -> ValidationReport:
    table = pa.Table.from_pylist(tally.shards) if tally.shards else None
    expectations = suite_for(spec)
    results = list(platform)
    suite_json: dict[str, Any] = {"name": f"{spec.key}/shards", "expectations": expectations}
    if table is not None:
        suite = ArrowSuite(expectations, table.schema, name=f"{spec.key}/shards")
        for batch in table.to_batches():
            suite.update(batch)
        results = [result_from_ge(r, False) for r in suite.results()] + results
        suite_json = suite.suite_json()
    else:
        results.insert(0, _platform("expect_table_row_count_to_be_between", 0, 1, 0, [], success=False))
    failed = sum(1 for r in results if not r["success"])
    return ValidationReport(
        success=failed == 0, evaluated=len(results), failed=failed, results=results, suite=suite_json, rows=tally.items
    )


# --------------------------------------------------------------------------- drift


def _psi(reference: np.ndarray, current: np.ndarray) -> float:
    p = np.maximum(reference / max(reference.sum(), 1), PSI_EPSILON)
    c = np.maximum(current / max(current.sum(), 1), PSI_EPSILON)
    return float(np.sum((c - p) * np.log(c / p)))


def unigram_psi(reference: np.ndarray, current: np.ndarray, buckets: int = DRIFT_BUCKETS) -> float:
    """PSI of two unigram count vectors over buckets of token ids holding equal shares of the reference's tokens.

    Ids are ranked by their reference count (most frequent first); bucket k
    holds the ids whose cumulative reference share falls in [k/b, (k+1)/b);
    ids the reference never saw fall in the last (rarest) bucket.
    """
    n = max(len(reference), len(current))
    ref = np.zeros(n, dtype=np.float64)
    cur = np.zeros(n, dtype=np.float64)
    ref[: len(reference)] = reference
    cur[: len(current)] = current
    order = np.argsort(-ref, kind="stable")
    share = np.cumsum(ref[order]) / max(ref.sum(), 1)
    bucket_of = np.minimum((np.concatenate([[0.0], share[:-1]]) * buckets).astype(int), buckets - 1)
    bucket_of[ref[order] == 0] = buckets - 1
    return _psi(
        np.bincount(bucket_of, weights=ref[order], minlength=buckets),
        np.bincount(bucket_of, weights=cur[order], minlength=buckets),
    )


def _drift_row(
    column: str, method: str, psi: float, judged: bool, spec: PipelineSpec, scope: str, note: str
) -> dict[str, Any]:
    limit = spec.max_drift_psi
    return {"column": column, "method": method, "psi": psi, "ks": None, "ks_pvalue": None, "judged": judged,
            "drifted": bool(judged and limit is not None and psi > limit), "note": note, "scope": scope}


def _drift(
    spec: PipelineSpec, tally: Tally, reference: Optional[dict[str, Any]], new_files: Optional[set[str]]
) -> list[dict[str, Any]]:
    if reference is None:
        return []
    scope = (
        f"the new delivery ({len(new_files)} file(s), {tally.new_items} item(s))" if new_files else "the whole version"
    ) + f" against version {reference['md5'][:12]}"
    if isinstance(spec.shards, TextShards):
        current = tally.new_counts if tally.new_counts is not None else np.zeros(spec.shards.vocabulary)
        ref = np.asarray(reference["counts"], dtype=np.float64)
        tokens = int(current.sum())
        return [
            _drift_row(
                "tokens",
                "unigram-psi",
                unigram_psi(ref, current),
                tokens >= DRIFT_MIN_TOKENS,
                spec,
                scope,
                f"{DRIFT_BUCKETS} frequency buckets; {tokens} tokens measured"
                + ("" if tokens >= DRIFT_MIN_TOKENS else f", fewer than {DRIFT_MIN_TOKENS}: not judged"),
            )
        ]
    judged = tally.new_items >= DRIFT_MIN_IMAGES
    edges = np.asarray(reference["mean_edges"], dtype=np.float64)
    cur_means = np.asarray(tally.new_means, dtype=np.float64)
    ref_hist = np.asarray(reference["mean_counts"], dtype=np.float64)
    cur_hist = np.bincount(
        np.clip(np.searchsorted(edges, cur_means, side="right") - 1, 0, len(ref_hist) - 1), minlength=len(ref_hist)
    )
    labels_now = tally.new_labels if tally.new_labels is not None else np.zeros(len(reference["labels"]))
    note = f"{tally.new_items} image(s) measured" + ("" if judged else f", fewer than {DRIFT_MIN_IMAGES}: not judged")
    return [
        _drift_row("pixel_mean", "psi-quantiles", _psi(ref_hist, cur_hist), judged, spec, scope, note),
        _drift_row(
            "label",
            "psi-categories",
            _psi(np.asarray(reference["labels"], dtype=np.float64), labels_now),
            judged,
            spec,
            scope,
            note,
        ),
    ]


def _profile(spec: PipelineSpec, tally: Tally) -> dict[str, Any]:
    """What the next version's drift is measured against: unigram counts, or pixel-mean quantile bins and label
    counts."""
    if isinstance(spec.shards, TextShards):
        counts = tally.counts if tally.counts is not None else np.zeros(spec.shards.vocabulary, dtype=np.int64)
        return {"kind": "text", "counts": counts.astype(int).tolist()}
    means = np.asarray(tally.means, dtype=np.float64)
    edges = np.unique(np.quantile(means, np.linspace(0, 1, PIXEL_BINS + 1))) if len(means) else np.array([0.0, 1.0])
    edges[0], edges[-1] = -np.inf, np.inf
    hist = np.bincount(
        np.clip(np.searchsorted(edges, means, side="right") - 1, 0, len(edges) - 2), minlength=len(edges) - 1
    )
    labels = tally.labels if tally.labels is not None else np.zeros(len(spec.shards.labels) if spec.shards else 0)
    return {
        "kind": "image",
        "mean_edges": [float(e) if np.isfinite(e) else (-1e300 if e < 0 else 1e300) for e in edges],
        "mean_counts": hist.astype(int).tolist(),
        "labels": np.asarray(labels).astype(int).tolist(),
    }


# --------------------------------------------------------------------------- the version


def _new_files(store: FileStore, raw_uri: str, reference: Optional[dict[str, Any]]) -> Optional[set[str]]:
    """Landing files of this version (relative to the store, as shards name them) that the reference version did not
    have
    in the same content (None: no reference, or no file is new)."""
    if reference is None or not store.exists(f"{reference['raw_uri']}/manifest.json"):
        return None
    before = {
        (f["uri"], f.get("content_hash")) for f in store.read_json(f"{reference['raw_uri']}/manifest.json")["files"]
    }
    now = store.read_json(f"{raw_uri}/manifest.json")["files"]
    return {store_relative(store, f["uri"]) for f in now if (f["uri"], f.get("content_hash")) not in before} or None


def validate_shard_version(store: FileStore, spec: PipelineSpec, raw: dict[str, Any]) -> ShardVersionOutcome:
    """Validate one shard version, measure drift, apply the policy, and quarantine it or make it the latest accepted
    one.

    Args:
        store: The object store.
        spec: The sharded pipeline.
        raw: `raw_data`'s value (`uri`: the version directory, `md5`, ...).
    """
    assert spec.shards is not None
    md5, raw_uri = raw["md5"], raw["uri"]
    latest_uri = naming.validated_latest(store, spec.team, spec.name)
    latest = store.read_json(latest_uri) if store.exists(latest_uri) else None
    reference = None
    if (
        latest is not None
        and latest["md5"] != md5
        and latest.get("profile_uri")
        and store.exists(latest["profile_uri"])
    ):
        reference = {**store.read_json(latest["profile_uri"]), "md5": latest["md5"], "raw_uri": latest["raw_uri"]}
    new_files = _new_files(store, raw_uri, reference)
    problems = Problems()
    tally = read_version(store, spec, raw_uri, new_files, problems)
    enough = _platform("trainyard_min_items", tally.items, spec.min_rows, 0, [], success=tally.items >= spec.min_rows)
    platform = [{**enough, "kwargs": {"min_value": spec.min_rows}}]
    if isinstance(spec.shards, TextShards):
        platform.append(
            _rate_check("trainyard_empty_document_rate", tally.empty, tally.items, spec.shards.max_empty_rate, problems)
        )
        platform.append(
            _rate_check("trainyard_long_document_rate", tally.long, tally.items, spec.shards.max_long_rate, problems)
        )
    platform += _duplicates(tally, spec.shards.max_duplicate_rate, problems)
    if tally.items < spec.min_rows:
        problems.add(f"{tally.items} item(s), fewer than min_rows {spec.min_rows}")
    report = _report(spec, tally, platform)
    if problems.count and report.success:
        # A problem no expectation covers (a split without items, a document without its end id) still fails the
        # version.
        extra = _platform("trainyard_no_problems", problems.count, 0, problems.count, problems.lines[:5])
        report = ValidationReport(success=False, evaluated=report.evaluated + 1, failed=report.failed + 1,
                                  results=[*report.results, extra], suite=report.suite, rows=report.rows)
    drift_rows = _drift(spec, tally, reference, new_files)
    if latest is not None and latest["md5"] == md5 and latest.get("drift_uri") and store.exists(latest["drift_uri"]):
        drift_rows = store.read_json(latest["drift_uri"])  # this version again: the drift measured when it was new
    verdict = decide(report, drift_rows, spec, release_of(store, spec.team, spec.name, md5))
    if not verdict.accepted:
        kept = _quarantine(store, spec, raw, verdict, report, problems, tally, drift_rows)
        return ShardVersionOutcome(
            verdict, report, problems.lines, problems.count, tally.shards, drift_rows, kept, None
        )
    split_id = f"{md5}-{spec.fingerprint()}"
    base = naming.validated_dir(store, spec.team, spec.name, split_id)
    store.write_json(f"{base}/profile.json", _profile(spec, tally))
    store.write_json(f"{base}/drift.json", drift_rows)
    store.write_json(f"{base}/shards.json", tally.shards)
    store.write_json(latest_uri, {"md5": md5, "raw_uri": raw_uri, "split_id": split_id, "kind": "shards",
                                  "profile_uri": f"{base}/profile.json", "drift_uri": f"{base}/drift.json"})
    items = {s: 0 for s in shard_format.SPLITS}
    for row in tally.shards:
        items[row["split"]] += row["items"]
    value = {
        "md5": md5,
        "split_id": split_id,
        **{s: f"{raw_uri}/{s}" for s in shard_format.SPLITS},
        "rows": items,
        "set_aside": 0,
        "profile": f"{base}/profile.json",
    }
    return ShardVersionOutcome(verdict, report, problems.lines, problems.count, tally.shards, drift_rows, None, value)


def _quarantine(
    store: FileStore,
    spec: PipelineSpec,
    raw: dict[str, Any],
    verdict: Verdict,
    report: ValidationReport,
    problems: Problems,
    tally: Tally,
    drift_rows: list[dict[str, Any]],
) -> str:
    """Keep the rejected version's report under `quarantine/<team>/<name>/<md5>/` (its shards stay where they are,
    immutable);
    a version whose shards were altered is marked damaged so the next ingest writes it again."""
    where_ = naming.quarantine_dir(store, spec.team, spec.name, raw["md5"])
    if any(not row["checksum_ok"] for row in tally.shards):
        store.write_json(
            f"{raw['uri']}/{DAMAGED}",
            {"at": utc_now(), "shards": [f"{r['split']}/{r['shard']}" for r in tally.shards if not r["checksum_ok"]]},
        )
    store.write_json(
        f"{where_}/report.json",
        {
            "kind": "snapshot",
            "pipeline": spec.key,
            "md5": raw["md5"],
            "quarantined_at": utc_now(),
            "data": raw["uri"],
            "raw": raw,
            "policy": spec.on_bad_data,
            "reasons": verdict.reasons,
            "problems": problems.lines,
            "problem_count": problems.count,
            "shards": tally.shards,
            "validation": report.model_dump(mode="json"),
            "drift": drift_rows,
        },
    )
    return where_


def shards_markdown(rows: list[dict[str, Any]], limit: int = 60) -> str:
    """The per-shard statistics as a Markdown table (the first `limit` shards)."""
    if not rows:
        return "no shards\n"
    columns = list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows[:limit]:
        lines.append("| " + " | ".join(md_cell(f"{v:.2f}" if isinstance(v, float) else v) for v in row.values()) + " |")
    more = f"\n{len(rows) - limit} more shard(s) not shown\n" if len(rows) > limit else ""
    return "\n".join(lines) + "\n" + more


def problems_markdown(lines: list[str], count: int) -> str:
    """Every problem found (as kept), one bullet each."""
    if not count:
        return "no problems\n"
    more = f"\n\n… and {count - len(lines)} more (see the quarantine report)" if count > len(lines) else ""
    return "\n".join(f"- {md_cell(line, width=400)}" for line in lines[:200]) + more + "\n"
