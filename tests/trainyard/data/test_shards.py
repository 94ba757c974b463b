"""Ingest of sharded pipelines: landing files to litdata split directories, versions, incremental landing, tokenizer,
s3."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from resources.storage import ObjectStore
from tests.trainyard.data.shard_fixtures import (
    IMAGE_PREFIX,
    TEXT_PREFIX,
    digit_pngs,
    image_spec,
    sentences,
    text_spec,
    write_corpus,
    write_jsonl,
)
from training import shard_format
from trainyard.data.ingest import IngestRejected, load_manifest, pending_files
from trainyard.data.quarantine import list_quarantine
from trainyard.data.shards import ingest_shards, tokenizer_uri


def _store(tmp_path: Path) -> ObjectStore:
    return ObjectStore(root=str(tmp_path))


def _landing_documents(files: list[Path], root: Path) -> dict[tuple[str, int], bytes]:
    """What each landing document is, read here independently of the engine: (file below the store root, line) -> its
    UTF-8 bytes."""
    out = {}
    for path in files:
        name = str(path.relative_to(root))
        if path.suffix == ".jsonl":
            for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                out[(name, n)] = json.loads(line)["text"].encode("utf-8")
        else:
            out[(name, 0)] = path.read_bytes()
    return out


def _documents(split_dir: str) -> list[dict]:
    return pq.read_table(os.path.join(split_dir, shard_format.DOCUMENTS_FILE)).to_pylist()


def _split_of_each(version_dir: str) -> dict[str, str]:
    return {d["sha1"]: split for split in shard_format.SPLITS for d in _documents(f"{version_dir}/{split}")}


def test_every_landing_document_is_one_item_of_one_split_with_its_tokens_and_end_id(tmp_path: Path) -> None:
    store, spec = _store(tmp_path), text_spec()
    files = write_corpus(tmp_path)
    result = ingest_shards(store, spec)
    expected = _landing_documents(files, tmp_path)
    seen: dict[tuple[str, int], bytes] = {}
    for split in shard_format.SPLITS:
        local = f"{result.snapshot.uri}/{split}"
        meta = shard_format.read_meta(local)
        assert (
            meta["kind"] == "text" and meta["vocab_size"] == 257 and meta["eos_id"] == 256 and meta["dtype"] == "int32"
        )
        docs = _documents(local)
        chunks = json.load(open(f"{local}/index.json"))["chunks"]
        ids = [
            d for c in chunks for d in shard_format.text_chunk_documents(open(f"{local}/{c['filename']}", "rb").read())
        ]
        assert len(ids) == len(docs) == meta["items"]
        for doc, tokens in zip(docs, ids):
            assert tokens[-1] == 256 and doc["tokens"] == len(tokens)
            seen[(doc["file"], doc["record"])] = tokens[:-1].astype(np.uint8).tobytes()
        counts = np.load(f"{local}/{shard_format.TOKEN_COUNTS_FILE}")
        assert counts.shape == (257,) and counts.sum() == meta["tokens"] == sum(len(t) for t in ids)
    assert seen == expected
    assert result.snapshot.rows == len(expected) and sorted(result.snapshot.files) == sorted(str(f) for f in files)
    assert {s: c["items"] for s, c in result.splits.items()} == {
        s: shard_format.read_meta(f"{result.snapshot.uri}/{s}")["items"] for s in shard_format.SPLITS
    }


def test_litdata_streams_samples_of_block_size_plus_one_from_the_train_split(tmp_path: Path) -> None:
    store, spec = _store(tmp_path), text_spec()
    write_corpus(tmp_path)
    result = ingest_shards(store, spec)
    train = f"{result.snapshot.uri}/train"
    dataset = shard_format.open_split(train, sample_tokens=spec.shards.block_size + 1)
    stream = np.concatenate([np.asarray(dataset[i]) for i in range(len(dataset))])
    chunks = json.load(open(f"{train}/index.json"))["chunks"]
    assert len(dataset) == sum(c["dim"] // 17 for c in chunks) > 0
    whole = np.concatenate(
        [d for c in chunks for d in shard_format.text_chunk_documents(open(f"{train}/{c['filename']}", "rb").read())]
    )
    assert set(stream.tolist()) <= set(whole.tolist()) and stream[:17].tolist() == whole[:17].tolist()


def test_the_same_landing_files_give_the_same_version_in_another_store(tmp_path: Path) -> None:
    write_corpus(tmp_path / "a")
    shutil.copytree(tmp_path / "a" / "landing", tmp_path / "b" / "landing")
    first = ingest_shards(_store(tmp_path / "a"), text_spec())
    second = ingest_shards(_store(tmp_path / "b"), text_spec())
    assert first.snapshot.md5 == second.snapshot.md5 and len(first.snapshot.md5) == 32
    assert _split_of_each(first.snapshot.uri) == _split_of_each(second.snapshot.uri)
    assert set(_split_of_each(first.snapshot.uri).values()) == {"train", "val", "test"}
    again = ingest_shards(_store(tmp_path / "a"), text_spec())
    assert again.reused_snapshot and again.snapshot.md5 == first.snapshot.md5


def test_a_new_delivery_tokenizes_only_its_files_and_earlier_documents_keep_their_split(tmp_path: Path) -> None:
    store, spec = _store(tmp_path), text_spec()
    write_corpus(tmp_path)
    first = ingest_shards(store, spec)
    parts_dir = tmp_path / "data" / "language" / "corpus" / "ingest" / "shard_parts"
    parts_before = {p.name: p.stat().st_mtime_ns for p in parts_dir.iterdir()}
    write_jsonl(tmp_path / TEXT_PREFIX / "part-9.jsonl", sentences(15, 9))
    assert [f.uri.rsplit("/", 1)[-1] for f in pending_files(store, spec)] == ["part-9.jsonl"]
    second = ingest_shards(store, spec)
    parts_after = {p.name: p.stat().st_mtime_ns for p in parts_dir.iterdir()}
    assert len(parts_after) == len(parts_before) + 1 and all(parts_after[n] == t for n, t in parts_before.items())
    assert [r.uri.rsplit("/", 1)[-1] for r in second.ingested] == ["part-9.jsonl"] and second.unchanged == 4
    assert second.snapshot.md5 != first.snapshot.md5 and second.snapshot.rows == first.snapshot.rows + 15
    before, after = _split_of_each(first.snapshot.uri), _split_of_each(second.snapshot.uri)
    assert all(after[sha] == split for sha, split in before.items())
    assert pending_files(store, spec) == []


def test_a_redelivered_file_is_a_duplicate_and_a_removed_one_leaves_the_version(tmp_path: Path) -> None:
    store, spec = _store(tmp_path), text_spec()
    files = write_corpus(tmp_path)
    first = ingest_shards(store, spec)
    shutil.copy(files[0], tmp_path / TEXT_PREFIX / "resent.jsonl")
    resent = ingest_shards(store, spec)
    assert [r.duplicate_of for r in resent.duplicates] == [str(files[0])]
    assert resent.reused_snapshot and resent.snapshot.md5 == first.snapshot.md5
    files[1].unlink()
    smaller = ingest_shards(store, spec)
    assert smaller.removed == [str(files[1])] and str(files[1]) not in smaller.snapshot.files
    assert smaller.snapshot.rows == first.snapshot.rows - 20
    assert all(
        d["file"] != str(files[1].relative_to(tmp_path))
        for s in shard_format.SPLITS
        for d in _documents(f"{smaller.snapshot.uri}/{s}")
    )


def test_the_bpe_is_trained_on_the_first_delivery_then_frozen(tmp_path: Path) -> None:
    store, spec = _store(tmp_path), text_spec(tokenizer="bpe", vocab_size=300)
    write_corpus(tmp_path)
    first = ingest_shards(store, spec)
    frozen = store.read_bytes(tokenizer_uri(store, spec))
    meta = shard_format.read_meta(f"{first.snapshot.uri}/train")
    assert meta["vocab_size"] == 300 and meta["eos_id"] == 0
    write_jsonl(tmp_path / TEXT_PREFIX / "part-7.jsonl", ["zebra quartz jukebox " * 30] * 3)
    second = ingest_shards(store, spec)
    assert store.read_bytes(tokenizer_uri(store, spec)) == frozen and second.tokenizer == first.tokenizer
    assert open(f"{second.snapshot.uri}/train/tokenizer.json", "rb").read() == frozen
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(frozen.decode())
    assert 0 < tok.get_vocab_size() <= 300 and tok.token_to_id("<|endoftext|>") == 0


def test_undecodable_files_are_rejected_naming_file_and_line_and_warn_skips_them(tmp_path: Path) -> None:
    store = _store(tmp_path)
    write_corpus(tmp_path)
    land = tmp_path / TEXT_PREFIX
    (land / "latin.txt").write_bytes("caf\xe9".encode("latin-1"))
    (land / "broken.jsonl").write_text(
        '{"text": "fine"}\n{"text": "also fine"}\n{"text": "cut\n{"tokens": "nope"}\n', encoding="utf-8"
    )
    with pytest.raises(IngestRejected) as caught:
        ingest_shards(store, text_spec())
    messages = [i.message for r in caught.value.records for i in r.issues]
    assert any(
        m.startswith(f"{land}/broken.jsonl line 3: not a JSON object (Invalid control character at)") for m in messages
    )
    assert (
        f"{land}/broken.jsonl line 4: needs a text field 'text' (a string) or a tokens field 'tokens' (a list of "
        "integers)"
        in messages
    )
    assert f"{land}/latin.txt line 1: not valid UTF-8 (byte 3)" in messages
    entries = {e.summary for e in list_quarantine(store, "language/corpus") if e.kind == "file"}
    assert any("broken.jsonl line 3" in s for s in entries) and any("latin.txt" in s for s in entries)
    warned = ingest_shards(store, text_spec(on_bad_data="warn"))
    assert str(land / "broken.jsonl") not in warned.snapshot.files and warned.snapshot.rows == 61


def test_s3_landing_is_ingested_and_litdata_streams_the_split_from_s3(
    s3_endpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = ObjectStore(root=s3_endpoint.root("shards"), endpoint_url=s3_endpoint.url)
    local = tmp_path / "src"
    for path in write_corpus(local):
        store.write_bytes(store.uri(str(path.relative_to(local))), path.read_bytes())
    spec = text_spec()
    result = ingest_shards(store, spec)
    assert result.snapshot.uri.startswith("s3://") and result.snapshot.rows == 61
    same = (
        ingest_shards(ObjectStore(root=str(tmp_path / "local")), spec)
        if shutil.copytree(local / "landing", tmp_path / "local" / "landing")
        else None
    )
    assert same is not None and same.snapshot.md5 == result.snapshot.md5
    train = f"{result.snapshot.uri}/train"
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint.url)
    assert shard_format.storage_options_for(train) == {"endpoint_url": s3_endpoint.url}
    meta = shard_format.read_meta(train)
    dataset = shard_format.open_split(train, sample_tokens=17, cache_dir=str(tmp_path / "cache"), max_cache_size="10MB")
    samples = [dataset[i] for i in range(len(dataset))]
    assert (
        meta["items"] == result.splits["train"]["items"] and len(samples) > 0 and all(s.shape == (17,) for s in samples)
    )
    local_samples = shard_format.open_split(f"{same.snapshot.uri}/train", sample_tokens=17)
    assert [s.tolist() for s in samples] == [local_samples[i].tolist() for i in range(len(local_samples))]


def test_digit_images_become_items_with_their_label_and_a_stable_id(tmp_path: Path) -> None:
    store, spec = _store(tmp_path), image_spec()
    pngs = digit_pngs(tmp_path, 60)
    result = ingest_shards(store, spec)
    assert result.snapshot.rows == 60 and result.tokenizer == ""
    items = []
    for split in shard_format.SPLITS:
        local = f"{result.snapshot.uri}/{split}"
        meta = shard_format.read_meta(local)
        assert meta["shape"] == [8, 8] and meta["labels"] == list(range(10))
        dataset = shard_format.open_split(local)
        items += [(dataset[i], d) for i, d in enumerate(_documents(local))]
    by_file = {str(p.relative_to(tmp_path)): p for p in pngs}
    from PIL import Image

    for item, doc in items:
        path = by_file[doc["file"]]
        assert np.array_equal(item["image"], np.asarray(Image.open(path))) and item["image"].dtype == np.uint8
        assert item["label"] == doc["label"] == int(path.parent.name)
        assert item["id"] == shard_format.image_id(f"{path.parent.name}/{path.name}")
    assert len({item["id"] for item, _ in items}) == 60


def test_an_image_outside_a_label_directory_or_truncated_is_rejected(tmp_path: Path) -> None:
    store = _store(tmp_path)
    pngs = digit_pngs(tmp_path, 30)
    land = tmp_path / IMAGE_PREFIX
    (land / "11").mkdir()
    from PIL import Image

    Image.fromarray(np.full((8, 8), 7, np.uint8), mode="L").save(land / "11" / "x.png")
    (land / "3" / "cut.png").write_bytes(pngs[1].read_bytes()[:40])
    with pytest.raises(IngestRejected) as caught:
        ingest_shards(store, image_spec())
    reasons = {
        r.uri.rsplit("/", 2)[-2] + "/" + r.uri.rsplit("/", 1)[-1]: [i.message for i in r.issues]
        for r in caught.value.records
    }
    assert set(reasons) == {"11/x.png", "3/cut.png"}
    assert "names no label" in reasons["11/x.png"][0] and "not a readable PNG" in reasons["3/cut.png"][0]
    assert load_manifest(store, image_spec()).snapshot is None
