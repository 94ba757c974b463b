"""A sharded pipeline's data assets in real Dagster runs: raw_data pins a shard version, validated_data checks and
splits it.

The runs go through the pipeline's own `prepare` job (raw_data, validated_data
with its blocking `expectations` check and its `drift` check) on the local
resources (object store, DVC), as the platform runs them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from dagster import AssetKey, DagsterInstance

from pipelines.environments import local_resources
from pipelines.factory import build_definitions
from resources.versioning import parse_dvc_file
from tests.trainyard.data.shard_fixtures import TEXT_PREFIX, text_spec, write_corpus
from training import shard_format
from trainyard import naming
from trainyard.naming import RAW_DATA, VALIDATED_DATA, job_names
from trainyard.spec import PipelineSpec


def _run(spec: PipelineSpec, resources: dict[str, Any], instance: DagsterInstance) -> Any:
    defs = build_definitions(spec, resources=resources)
    keys = [AssetKey(naming.asset_path(spec, RAW_DATA)), AssetKey(naming.asset_path(spec, VALIDATED_DATA))]
    return defs.resolve_job_def(job_names(spec)["prepare"]).execute_in_process(
        instance=instance, asset_selection=keys, raise_on_error=False
    )


def _checks(result: Any) -> dict[str, Any]:
    return {
        e.check_name: e
        for e in (
            ev.asset_check_evaluation_data
            for ev in result.all_events
            if ev.event_type_value == "ASSET_CHECK_EVALUATION"
        )
    }


@pytest.mark.slow  # three real runs, each pinning with DVC in a subprocess: ~35 s
def test_a_corpus_becomes_a_pinned_checked_split_and_a_bad_delivery_is_blocked_until_fixed(tmp_path: Path) -> None:
    spec = text_spec()
    resources = local_resources(tmp_path)
    store = resources["store"]
    write_corpus(Path(store.root))
    (tmp_path / "dagster").mkdir()
    with DagsterInstance.local_temp(str(tmp_path / "dagster"), overrides={"telemetry": {"enabled": False}}) as instance:
        result = _run(spec, resources, instance)
        assert result.success
        raw = result.output_for_node(naming.node_name(spec, RAW_DATA))
        validated = result.output_for_node(naming.node_name(spec, VALIDATED_DATA))
        md5, _, path = parse_dvc_file(raw.dvc_file)
        assert md5 == raw.md5 and path.endswith("shards.tar")
        version = instance.get_latest_data_version_record(AssetKey(naming.asset_path(spec, RAW_DATA)))
        assert version is not None and version.asset_materialization.tags["dagster/data_version"] == raw.md5
        assert (
            validated.train == f"{raw.uri}/train"
            and validated.rows["train"] == shard_format.read_meta(validated.train)["items"]
        )
        checks = _checks(result)
        assert checks["expectations"].passed and checks["drift"].passed
        assert "checksum_ok" in checks["expectations"].metadata["shards"].value

        bad = Path(store.root) / TEXT_PREFIX / "b.jsonl"
        bad.write_text(
            json.dumps({"text": "fine"}) + "\n" + json.dumps({"tokens": [5, 70000]}) + "\n", encoding="utf-8"
        )
        blocked = _run(spec, resources, instance)
        assert not blocked.success
        check = _checks(blocked)["expectations"]
        assert not check.passed
        report = check.metadata["report"].value
        assert "landing/language/corpus/b.jsonl line 2: token id 70000 outside the vocabulary (257)" in report
        assert check.metadata["quarantine"].value.endswith(
            f"quarantine/language/corpus/{blocked.output_for_node(naming.node_name(spec, RAW_DATA)).md5}"
        )

        bad.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"tokens": [5, 70]}) + "\n", encoding="utf-8")
        fixed = _run(spec, resources, instance)
        assert fixed.success and _checks(fixed)["expectations"].passed
        assert fixed.output_for_node(naming.node_name(spec, VALIDATED_DATA)).md5 not in (raw.md5,)
