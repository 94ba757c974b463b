"""Validation of shard versions: every problem named by landing file and line, quarantine, the fix that unblocks,
drift."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from resources.storage import ObjectStore
from tests.trainyard.data.shard_fixtures import (
    IMAGE_PREFIX,
    TEXT_PREFIX,
    WORDS,
    digit_pngs,
    image_spec,
    sentences,
    text_spec,
    write_corpus,
    write_jsonl,
)
from training import shard_format
from trainyard.data.quarantine import list_quarantine, read_quarantine, release_quarantine
from trainyard.data.shard_validation import unigram_psi, validate_shard_version
from trainyard.data.shards import ingest_shards


def _validate(store: ObjectStore, spec):
    result = ingest_shards(store, spec)
    return result, validate_shard_version(store, spec, {"uri": result.snapshot.uri, "md5": result.snapshot.md5})


def test_a_clean_corpus_passes_with_one_row_per_shard_and_its_split_directories(tmp_path: Path) -> None:
    store, spec = ObjectStore(root=str(tmp_path)), text_spec()
    write_corpus(tmp_path)
    result, outcome = _validate(store, spec)
    assert outcome.verdict.accepted and outcome.problem_count == 0 and outcome.report.success
    chunks = {s: json.load(open(f"{result.snapshot.uri}/{s}/index.json"))["chunks"] for s in shard_format.SPLITS}
    assert [(r["split"], r["shard"], r["items"]) for r in outcome.shards] == [
        (s, c["filename"], c["chunk_size"]) for s in shard_format.SPLITS for c in chunks[s]
    ]
    assert sum(r["tokens"] + r["items"] for r in outcome.shards) == sum(
        shard_format.read_meta(f"{result.snapshot.uri}/{s}")["tokens"] for s in shard_format.SPLITS
    )
    expectations = {r["expectation"] for r in outcome.report.results}
    assert {
        "expect_column_values_to_be_in_set",
        "expect_column_values_to_be_between",
        "trainyard_duplicate_rate",
        "trainyard_empty_document_rate",
    } <= expectations
    value = outcome.value
    assert (
        value is not None
        and value["train"] == f"{result.snapshot.uri}/train"
        and value["split_id"].startswith(result.snapshot.md5)
    )
    assert value["rows"] == {s: c["items"] for s, c in result.splits.items()}
    assert outcome.drift == []


def test_a_corrupt_shard_is_named_quarantined_and_the_next_ingest_writes_it_again(tmp_path: Path) -> None:
    store, spec = ObjectStore(root=str(tmp_path)), text_spec()
    write_corpus(tmp_path)
    result = ingest_shards(store, spec)
    chunk = f"{result.snapshot.uri}/train/chunk-0-1.bin"
    data = bytearray(open(chunk, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(chunk, "wb").write(bytes(data))
    raw = {"uri": result.snapshot.uri, "md5": result.snapshot.md5}
    outcome = validate_shard_version(store, spec, raw)
    assert not outcome.verdict.accepted and outcome.value is None
    assert (
        outcome.problems[0].startswith("train/chunk-0-1.bin: sha256 ") and "altered in the store" in outcome.problems[0]
    )
    assert (
        outcome.problems[1].startswith("train/chunk-0-1.bin: holds ")
        and "landing/language/corpus/" in outcome.problems[1]
    )
    assert [r["checksum_ok"] for r in outcome.shards if r["shard"] == "chunk-0-1.bin" and r["split"] == "train"] == [
        False
    ]
    report = read_quarantine(store, "language/corpus", result.snapshot.md5)
    assert report["problems"] == outcome.problems and report["kind"] == "snapshot"
    again = ingest_shards(store, spec)
    assert not again.reused_snapshot and again.snapshot.md5 == result.snapshot.md5
    assert validate_shard_version(store, spec, raw).verdict.accepted


def test_a_token_id_outside_the_vocabulary_is_named_by_file_and_line_and_correcting_it_unblocks(tmp_path: Path) -> None:
    store, spec = ObjectStore(root=str(tmp_path)), text_spec()
    write_corpus(tmp_path)
    bad = tmp_path / TEXT_PREFIX / "b.jsonl"
    rows = [
        {"tokens": [104, 105, 33] * 3},
        {"tokens": [119, 111, 114, 100] * 2},
        {"tokens": [1, 2, 70000, 3, 900]},
        {"text": "fine text"},
    ]
    bad.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    first, outcome = _validate(store, spec)
    assert not outcome.verdict.accepted
    assert outcome.problems == [
        "landing/language/corpus/b.jsonl line 3: token id 70000 outside the vocabulary (257) (2 ids outside it)"
    ]
    failed = [r for r in outcome.report.results if not r["success"]]
    assert [(r["expectation"], r["column"]) for r in failed] == [("expect_column_values_to_be_between", "out_of_vocab")]
    assert [e.id for e in list_quarantine(store, "language/corpus") if e.kind == "snapshot"] == [first.snapshot.md5]
    rows[2] = {"tokens": [1, 2, 3]}
    bad.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    fixed, outcome = _validate(store, spec)
    assert fixed.snapshot.md5 != first.snapshot.md5 and outcome.verdict.accepted and outcome.problem_count == 0


def test_an_empty_document_is_named_and_removing_its_file_unblocks(tmp_path: Path) -> None:
    store, spec = ObjectStore(root=str(tmp_path)), text_spec()
    write_corpus(tmp_path)
    bad = write_jsonl(tmp_path / TEXT_PREFIX / "c.jsonl", ["one document", "", "another one"])
    _, outcome = _validate(store, spec)
    assert not outcome.verdict.accepted
    assert outcome.problems == [
        "landing/language/corpus/c.jsonl line 2: empty document (0 tokens, fewer than min_tokens 1)"
    ]
    rate = next(r for r in outcome.report.results if r["expectation"] == "trainyard_empty_document_rate")
    assert (
        not rate["success"]
        and rate["unexpected_count"] == 1
        and rate["unexpected_values"] == ["landing/language/corpus/c.jsonl line 2"]
    )
    tolerant = text_spec(max_empty_rate=0.05)
    assert validate_shard_version(
        store,
        tolerant,
        {"uri": ingest_shards(store, tolerant).snapshot.uri, "md5": ingest_shards(store, tolerant).snapshot.md5},
    ).verdict.accepted
    os.remove(bad)
    after, outcome = _validate(store, spec)
    assert outcome.verdict.accepted and str(bad) not in after.snapshot.files


def test_repeated_documents_beyond_the_rate_are_named_each(tmp_path: Path) -> None:
    store, spec = ObjectStore(root=str(tmp_path)), text_spec()
    write_corpus(tmp_path)
    write_jsonl(
        tmp_path / TEXT_PREFIX / "d.jsonl", ["the very same words", "something else entirely", "the very same words"]
    )
    _, outcome = _validate(store, spec)
    assert not outcome.verdict.accepted
    assert outcome.problems == [f"landing/language/corpus/d.jsonl line 3: repeats an earlier item ({split} split)"
                                for split in {r["split"] for r in outcome.shards if r["duplicates"]}]


def test_a_changed_token_distribution_is_drift_warned_or_rejected_by_policy(tmp_path: Path) -> None:
    store = ObjectStore(root=str(tmp_path))
    write_corpus(tmp_path, files=3, per_file=40)
    _, first = _validate(store, text_spec())
    assert first.verdict.accepted and first.drift == []
    write_jsonl(tmp_path / TEXT_PREFIX / "f.jsonl", sentences(60, 6))
    _, calm = _validate(store, text_spec())
    assert (
        calm.verdict.accepted
        and calm.drift[0]["psi"] < 0.1
        and calm.drift[0]["judged"]
        and not calm.drift[0]["drifted"]
    )
    shouting = tuple(w.upper() + "!!" for w in WORDS)
    write_jsonl(tmp_path / TEXT_PREFIX / "e.jsonl", sentences(60, 5, shouting))
    second_raw = ingest_shards(store, text_spec(on_drift="reject"))
    raw = {"uri": second_raw.snapshot.uri, "md5": second_raw.snapshot.md5}
    rejected = validate_shard_version(store, text_spec(on_drift="reject"), raw)
    (row,) = rejected.drift
    assert (
        row["column"] == "tokens"
        and row["drifted"]
        and row["psi"] > 0.25
        and "new delivery (1 file(s), 60 item(s))" in row["scope"]
    )
    assert not rejected.verdict.accepted and "drift above threshold in ['tokens']" in rejected.verdict.reasons
    warned = validate_shard_version(store, text_spec(), raw)
    assert warned.verdict.accepted and any("on_drift='warn': accepted" in w for w in warned.verdict.warnings)


def test_a_released_version_goes_through_with_its_problems_as_warnings(tmp_path: Path) -> None:
    store, spec = ObjectStore(root=str(tmp_path)), text_spec()
    write_corpus(tmp_path)
    write_jsonl(tmp_path / TEXT_PREFIX / "c.jsonl", ["", "text"])
    result, outcome = _validate(store, spec)
    assert not outcome.verdict.accepted
    release_quarantine(
        store, "language/corpus", result.snapshot.md5, reason="empty line checked with the owner", by="ana"
    )
    released = validate_shard_version(store, spec, {"uri": result.snapshot.uri, "md5": result.snapshot.md5})
    assert released.verdict.accepted and released.verdict.release["released_by"] == "ana"


def test_unigram_psi_is_zero_for_the_same_distribution_and_large_for_a_moved_one() -> None:
    ref = np.array([500, 300, 100, 50, 30, 20, 0, 0], dtype=np.int64)
    assert unigram_psi(ref, ref * 3) == pytest.approx(0.0, abs=1e-12)
    moved = np.array([0, 0, 0, 0, 0, 20, 500, 480], dtype=np.int64)
    assert unigram_psi(ref, moved) > 1.0


def test_a_wrong_shape_image_is_rejected_by_name_and_removing_it_unblocks(tmp_path: Path) -> None:
    store, spec = ObjectStore(root=str(tmp_path)), image_spec()
    digit_pngs(tmp_path, 80)
    odd = tmp_path / IMAGE_PREFIX / "4" / "big.npy"
    np.save(odd, np.zeros((16, 16), dtype=np.uint8))
    _, outcome = _validate(store, spec)
    assert not outcome.verdict.accepted
    assert outcome.problems == ["landing/vision/glyphs/4/big.npy: shape [16, 16], not the declared [8, 8]"]
    assert [r["expectation"] for r in outcome.report.results if not r["success"]] == [
        "expect_column_values_to_be_between"
    ]
    odd.unlink()
    result, outcome = _validate(store, spec)
    assert outcome.verdict.accepted and outcome.value is not None
    assert sum(outcome.value["rows"].values()) == 80 == result.snapshot.rows
    stats = [r for r in outcome.shards if r["items"]]
    assert all(0 <= r["min"] <= r["mean"] <= r["max"] <= 255 for r in stats)
