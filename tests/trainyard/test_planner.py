"""The capacity planner: exact estimates, choice order DDP -> FSDP -> FSDP x TP, and the no-fit error."""

from __future__ import annotations

import subprocess
import sys

import pytest

from resources.model_facts import describe_model
from training.spec import Distribution
from trainyard.capacity import (
    GIB,
    NothingFitsError,
    TransformerShape,
    bytes_per_param,
    checkpoint_gb,
    checkpoint_seconds,
    estimate_params,
    memory_per_device,
    plan,
    training_time,
)
from trainyard.metadata import Markdown
from trainyard.planner import DEVICE_MEMORY_ENV, ModelQuery, device_memory, plan_distribution, plan_trial, quantity_gib

B = 1_000_000_000


def test_bytes_per_param() -> None:
    assert bytes_per_param(2, "adam") == 2 + 2 + 8 + 4  # bf16 weights, grads; fp32 exp_avg, exp_avg_sq; fp32 master
    assert bytes_per_param(4, "adam") == 4 + 4 + 8
    assert bytes_per_param(2, "sgd") == 2 + 2 + 4
    assert bytes_per_param(4, "sgd") == 4 + 4


def test_exact_estimates_per_strategy() -> None:
    common = dict(params=10 * B, dtype_bytes=2, optimizer="adam", devices=8, activation_gb=4.0, fsdp_units=40)
    ddp = memory_per_device("ddp", **common)
    assert (ddp.model_states_gb, ddp.buffers_gb, ddp.activations_gb) == (160e9 / GIB, 20e9 / GIB, 4.0)
    fsdp = memory_per_device("fsdp", **common)
    # states / 8; two gathered units of weights + one of gradients, 10B / 40 params each, 2 bytes
    assert (fsdp.model_states_gb, fsdp.buffers_gb, fsdp.activations_gb) == (20e9 / GIB, 1.5e9 / GIB, 4.0)
    tp = memory_per_device("tp", tensor_parallel_size=2, **common)
    assert (tp.model_states_gb, tp.buffers_gb, tp.activations_gb) == (20e9 / GIB, 0.75e9 / GIB, 2.0)
    assert tp.total_gb == pytest.approx((20e9 + 0.75e9) / GIB + 2.0, rel=1e-15)
    # tensor parallel over all devices: no data-parallel dimension, nothing to gather
    assert memory_per_device("tp", tensor_parallel_size=8, **common).buffers_gb == 0.0
    # one FSDP unit: the whole model's weights and gradients are unsharded at once
    assert memory_per_device("fsdp", **{**common, "fsdp_units": 1}).buffers_gb == 40e9 / GIB


def test_transformer_activation_estimate() -> None:
    shape = TransformerShape(layers=2, hidden=1024, heads=16, seq_len=2048, micro_batch_size=2, vocab=1000)
    sbh = 2048 * 2 * 1024
    assert shape.activation_bytes() == 2 * sbh * 34 + 4 * 2048 * 2 * 1000
    assert shape.activation_bytes(tensor_parallel_size=2) == (2 * sbh * 34 + 4 * 2048 * 2 * 1000) / 2
    no_flash = TransformerShape(
        layers=2, hidden=1024, heads=16, seq_len=2048, micro_batch_size=2, flash_attention=False
    )
    assert no_flash.activation_bytes() == 2 * (sbh * 34 + 5 * 16 * 2048 * 2048 * 2)
    ckpt = TransformerShape(
        layers=2, hidden=1024, heads=16, seq_len=2048, micro_batch_size=2, activation_checkpointing=True
    )
    assert ckpt.activation_bytes() == 2 * 2 * sbh + sbh * 34


def test_ddp_when_it_fits() -> None:
    p = plan(params=1 * B, dtype_bytes=2, optimizer="adam", device_memory_gb=80, devices=8, activation_gb=2.0)
    assert (p.strategy, p.tensor_parallel_size) == ("ddp", 1)
    assert p.per_device_gb["ddp"] == pytest.approx((16e9 + 2e9) / GIB + 2.0, rel=1e-15)  # 18.76 GiB
    assert p.usable_gb == 72.0 and p.fits == {"ddp": True, "fsdp": True, "tp": True}
    assert "choose ddp" in p.reasoning
    assert p.distribution_kwargs() == {
        "nodes": 1,
        "procs_per_node": 8,
        "strategy": "ddp",
        "tensor_parallel_size": 1,
        "accelerator": "gpu",
    }


def test_choice_order_ddp_then_fsdp_then_smallest_tp() -> None:
    common = dict(params=7 * B, dtype_bytes=2, optimizer="adam", devices=8, fsdp_units=32)
    # DDP needs 18 bytes/param = 117.3 GiB: fits only a device larger than that
    assert plan(device_memory_gb=160, activation_gb=10, **common).strategy == "ddp"
    # FSDP: 13.04 states + 1.22 gathered + 10 activations
    fsdp = plan(device_memory_gb=79.6, activation_gb=10, **common)
    assert fsdp.strategy == "fsdp" and fsdp.fits["ddp"] is False
    assert fsdp.per_device_gb["fsdp"] == pytest.approx((14e9 + 6 * 7e9 / 32) / GIB + 10, rel=1e-15)
    # 100 GiB of activations: tp=2 halves them to 50 -> 13.04 + 0.61 + 50 = 63.65 <= 71.64
    tp2 = plan(device_memory_gb=79.6, activation_gb=100, **common)
    assert (tp2.strategy, tp2.tensor_parallel_size) == ("tp", 2) and tp2.fits == {
        "ddp": False,
        "fsdp": False,
        "tp": True,
    }
    assert tp2.per_device_gb["tp"] == pytest.approx((14e9 + 3 * 7e9 / 32) / GIB + 50, rel=1e-15)
    # 130 GiB: tp=2 gives 78.7 (no), tp=4 gives 13.04 + 0.31 + 32.5 = 45.85
    tp4 = plan(device_memory_gb=79.6, activation_gb=130, **common)
    assert (tp4.strategy, tp4.tensor_parallel_size) == ("tp", 4)
    assert tp4.distribution_kwargs()["tensor_parallel_size"] == 4


def test_tensor_parallel_stays_inside_a_node() -> None:
    # 2 nodes x 2 devices: tp can only be 2
    p = plan(
        params=7 * B,
        dtype_bytes=2,
        optimizer="adam",
        device_memory_gb=79.6,
        devices=4,
        nodes=2,
        activation_gb=60,
        fsdp_units=32,
    )
    assert (p.strategy, p.tensor_parallel_size) == ("tp", 2)
    one_per_node = plan(params=1 * B, dtype_bytes=2, optimizer="adam", device_memory_gb=80, devices=4, nodes=4)
    assert "tp" not in one_per_node.per_device_gb and "no tensor parallel group" in one_per_node.reasoning


def test_nothing_fits_says_what_would() -> None:
    shape = TransformerShape(layers=80, hidden=8192, heads=64, seq_len=4096)
    with pytest.raises(
        NothingFitsError, match=r"FSDP x TP \(tp=4\) would fit on 24 devices \(3 node\(s\) of 8\)"
    ) as err:
        plan(params=70 * B, dtype_bytes=2, optimizer="adam", device_memory_gb=79.6, devices=8, shape=shape)
    assert "DDP: 1258.5 GiB" in str(err.value)
    with pytest.raises(NothingFitsError, match="activations and gathered units alone exceed a device"):
        plan(params=70 * B, dtype_bytes=2, optimizer="adam", device_memory_gb=79.6, devices=8, nodes=8, shape=shape)


def test_invalid_arguments_name_the_field() -> None:
    with pytest.raises(ValueError, match=r"optimizer='lion' must be one of \['adam', 'sgd'\]"):
        plan(params=B, dtype_bytes=2, optimizer="lion", device_memory_gb=80, devices=8)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="nodes=3 must be >= 1 and divide devices=8"):
        plan(params=B, dtype_bytes=2, optimizer="adam", device_memory_gb=80, devices=8, nodes=3)
    with pytest.raises(ValueError, match="tensor_parallel_size=3 must be >= 2 and divide devices=8"):
        memory_per_device("tp", B, 2, "adam", 8, tensor_parallel_size=3)


def test_run_time_and_checkpoint_cost() -> None:
    cost = training_time(params=7 * B, tokens=1e12, devices=64, peak_tflops=989, mfu=0.4)
    assert cost.tokens_per_second == pytest.approx(64 * 989e12 * 0.4 / (6 * 7e9), rel=1e-15)
    assert cost.days == pytest.approx(1e12 / cost.tokens_per_second / 86400, rel=1e-15)
    assert checkpoint_gb(7 * B, 2, "adam") == 7e9 * 14 / GIB  # weights + master + 2 Adam states
    assert checkpoint_seconds(100.0, 5.0) == 20.0


def test_estimate_params_counts_tied_weights_once() -> None:
    from torch import nn

    emb = nn.Embedding(100, 8)
    head = nn.Linear(8, 100, bias=False)
    head.weight = emb.weight
    assert estimate_params(nn.Sequential(emb, nn.Linear(8, 8), head)) == 800 + 72
    with pytest.raises(TypeError, match="takes a torch.nn.Module, got int"):
        estimate_params(3)


def test_planner_imports_without_torch() -> None:
    code = "import sys, trainyard.planner; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


# --- plan_trial: strategy 'auto' resolved from the real model before launch ---

DIGITS_PARAMS = 64 * 64 + 64 + 64 * 10 + 10  # DigitsMLP(n_features=64, hidden=64, n_classes=10)
KIB = 1 / 1024 / 1024  # GiB
# Per device, fp32 + Adam, 2 devices, one FSDP unit: ddp 20 B/param (93.9 KiB), fsdp 16 (75.2), fsdp x tp=2 8 (37.6).


def _trial(strategy: str = "auto", procs: int = 2, nodes: int = 1, memory_gb: float = 16.0,
           path: str = "pipelines.vision.models:DigitsMLP", **over):
    from tests.pipelines.pipeline_fixtures import small_spec
    from trainyard.spec import ModelSpec

    spec = small_spec(
        model=ModelSpec(path=path, max_epochs=1),
        distribution=Distribution(nodes=nodes, procs_per_node=procs, strategy=strategy),
    )
    return plan_trial(
        spec, {"lr": 0.01, **over}, lambda: 10, environ={DEVICE_MEMORY_ENV: repr(memory_gb)}, describe=describe_model
    )


def test_auto_resolves_to_ddp_for_the_digits_model() -> None:
    p = _trial()
    assert (p.distribution.strategy, p.distribution.tensor_parallel_size, p.chosen_by, p.error) == (
        "ddp",
        1,
        "planner",
        None,
    )
    assert p.params == DIGITS_PARAMS and p.distribution.procs_per_node == 2
    assert p.reasoning.startswith("ddp fits: 93.9 KiB of 14.4 GiB usable per device. Chosen by the planner")
    assert f"{DIGITS_PARAMS:,} parameters, 4-byte weights and adam = 16 bytes" in p.reasoning
    table = p.table_markdown().splitlines()
    assert table[0] == "| strategy | params | grads | optimizer | buffers | activations | total | usable | fits |"
    assert (
        table[2] == "| **ddp** (chosen) | 18.8 KiB | 18.8 KiB | 37.6 KiB | 18.8 KiB | 0 | 93.9 KiB | 14.4 GiB | yes |"
    )
    assert [row.split(" | ")[0] for row in table[3:]] == ["| fsdp", "| fsdp x tp (tp=2)"]
    assert _trial(hidden=128).params == 64 * 128 + 128 + 128 * 10 + 10  # the trial's own hyperparameters


def test_auto_resolves_to_fsdp_when_device_memory_is_tiny() -> None:
    p = _trial(memory_gb=90 * KIB, path="pipelines.vision.models:DigitsParallelMLP")  # 81 KiB usable
    assert (p.distribution.strategy, p.distribution.tensor_parallel_size, p.error) == ("fsdp", 1, None)
    assert p.reasoning.startswith("ddp needs 93.9 KiB > 81.0 KiB; fsdp fits: 75.2 KiB of 81.0 KiB usable per device")


def test_auto_resolves_to_tensor_parallel_dividing_the_world_size() -> None:
    p = _trial(memory_gb=50 * KIB, path="pipelines.vision.models:DigitsParallelMLP")  # 45 KiB usable
    assert (p.distribution.strategy, p.distribution.tensor_parallel_size) == ("tp", 2)
    assert "fsdp needs 75.2 KiB > 45.0 KiB; fsdp x tp (tp=2) fits: 37.6 KiB" in p.reasoning
    # 4 devices, 27 KiB usable: fsdp 12 B/param (56.4 KiB), tp=2 8 (37.6) do not fit; tp=4 4 (18.8, nothing to gather)
    # does
    p4 = _trial(procs=4, memory_gb=30 * KIB, path="pipelines.vision.models:DigitsParallelMLP")
    assert (p4.distribution.strategy, p4.distribution.tensor_parallel_size, p4.distribution.world_size) == ("tp", 4, 4)
    # 2 nodes x 2: tensor parallel stays inside a node, so tp=2 (dividing the world size 4) is the only size tried
    d = plan_distribution(Distribution(nodes=2, procs_per_node=2, strategy="auto"), DIGITS_PARAMS, 4, 50 * KIB)
    assert (d.distribution.strategy, d.distribution.tensor_parallel_size, d.distribution.data_parallel_size) == (
        "tp",
        2,
        2,
    )


def test_nothing_fits_names_the_field() -> None:
    with pytest.raises(
        NothingFitsError, match=r"^distribution\.strategy='auto': no strategy fits 9\.0 KiB usable per device"
    ) as err:
        plan_distribution(
            Distribution(procs_per_node=2, strategy="auto"), DIGITS_PARAMS, 4, 10 * KIB, device_memory_source="test"
        )
    assert "distribution.procs_per_node" in str(err.value) and DEVICE_MEMORY_ENV in str(err.value)
    p = _trial(memory_gb=10 * KIB)
    assert p.error is not None and p.error.startswith("distribution.strategy='auto': no strategy fits")
    assert p.distribution.strategy == "auto"  # nothing to launch with


def test_auto_only_chooses_what_the_model_supports() -> None:
    p = _trial(memory_gb=90 * KIB)  # fsdp would fit, but DigitsMLP is no ParallelizableModule
    assert p.error is not None and "model DigitsMLP does not support strategy 'fsdp'" in p.error
    bad = _trial(strategy="ddp", depth=3)  # fails before launch, like the pod would
    assert bad.error is not None and "rejected hyperparameters" in bad.error and "depth" in bad.error


def test_fixed_strategy_is_kept_with_a_warning_when_it_does_not_fit() -> None:
    p = _trial(strategy="ddp", memory_gb=90 * KIB)
    assert (p.distribution.strategy, p.chosen_by, p.error) == ("ddp", "user", None)
    assert p.warnings == (
        "distribution.strategy='ddp' may not fit: ddp (fixed by the pipeline) needs 93.9 KiB > 81.0 KiB usable per "
        "device "
        "and may run out of memory; strategy 'auto' would choose fsdp (75.2 KiB)",
    )
    assert "**ddp** (fixed)" in p.table_markdown() and p.metadata()["plan_warning"] == p.warnings[0]
    ok = _trial(strategy="fsdp", path="pipelines.vision.models:DigitsParallelMLP")
    assert ok.warnings == () and ok.reasoning.startswith(
        "fsdp (fixed by the pipeline) fits: 75.2 KiB of 14.4 GiB usable per device; strategy 'auto' would choose ddp"
    )


def _never(query: ModelQuery):
    raise AssertionError(f"a gbt trial's model was described: {query}")


def test_gbt_is_not_planned() -> None:
    from trainyard.spec import ColumnSpec, ModelSpec, PipelineSpec, PromotionSpec, SourceSpec

    spec = PipelineSpec(
        team="t",
        name="p",
        source=SourceSpec(prefix="landing/t/p"),
        columns={"x": ColumnSpec(dtype="float"), "y": ColumnSpec(dtype="float")},
        target="y",
        model=ModelSpec(task="gbt", monitor="val_rmse", monitor_mode="min"),
        promotion=PromotionSpec(metric="test_rmse", mode="min"),
        distribution=Distribution(strategy="auto"),
    )
    p = plan_trial(spec, {}, lambda: 0, describe=_never)
    assert (p.chosen_by, p.distribution.strategy, p.estimates) == ("skipped", "ddp", ())
    meta = p.metadata()
    assert meta["strategy"] == "none (one process)" and "gbt task" in meta["plan_reasoning"] and "plan" not in meta
    assert isinstance(meta["plan_reasoning"], Markdown)


def test_auto_is_a_pipeline_setting_only() -> None:
    from pydantic import ValidationError

    from training.spec import DataSpec, ImportTarget, TrainSpec

    with pytest.raises(
        ValidationError, match="tensor_parallel_size=2 with strategy 'auto': the planner picks the size"
    ):
        Distribution(procs_per_node=2, strategy="auto", tensor_parallel_size=2)
    data = DataSpec(train_uri="a", val_uri="b", test_uri="c", features=["x"], target="y", version="v")
    with pytest.raises(
        ValidationError, match="distribution.strategy 'auto' must be resolved by trainyard.planner.plan_trial"
    ):
        TrainSpec(pipeline="t/p", trial_id="trial-0000", model=ImportTarget(path="m:M"), data=data, output_uri="/o",
                  distribution=Distribution(strategy="auto"))


def test_device_memory_sources() -> None:
    from types import SimpleNamespace

    cpu2 = Distribution(procs_per_node=2)
    assert device_memory(cpu2, None, {DEVICE_MEMORY_ENV: "24"}) == (24.0, f"{DEVICE_MEMORY_ENV}=24")
    assert device_memory(cpu2, SimpleNamespace(device_memory_gb=40.0), {})[0] == 40.0
    assert device_memory(Distribution(procs_per_node=8, accelerator="gpu"), None, {})[0] == 79.6
    pod = device_memory(cpu2, SimpleNamespace(memory="8Gi", memory_limit=None), {})
    assert pod == (4.0, "SimpleNamespace pod memory 8Gi / 2 process(es) per pod")
    host, source = device_memory(cpu2, None, {})
    assert host > 0 and source.startswith("host RAM")
    assert (quantity_gib("512Mi"), quantity_gib("2G"), quantity_gib(str(GIB))) == (0.5, 2e9 / GIB, 1.0)
    with pytest.raises(ValueError, match=f"{DEVICE_MEMORY_ENV}='lots' is not a number of GiB"):
        device_memory(cpu2, None, {DEVICE_MEMORY_ENV: "lots"})


def test_trial_model_materialization_carries_the_plan(tmp_path, monkeypatch) -> None:
    from dagster import AssetKey

    from pipelines.factory import build_definitions, job_names
    from tests.pipelines.pipeline_fixtures import small_spec
    from tests.pipelines.sweep_drill import TrivialLauncher, drill_resources, open_instance, prepared_home
    from trainyard.search import FloatParam, SearchSpec

    monkeypatch.setenv(DEVICE_MEMORY_ENV, "16")
    spec = small_spec(
        search=SearchSpec(
            params={"lr": FloatParam(low=1e-3, high=1e-1, log=True)}, n_trials=1, sampler="random", seed=7
        ),
        distribution=Distribution(procs_per_node=2, strategy="auto"),
    )
    resources = drill_resources(tmp_path, TrivialLauncher())
    instance = open_instance(tmp_path)
    sweep = prepared_home(tmp_path, spec, resources, instance)
    defs = build_definitions(spec, resources=resources)
    result = defs.resolve_job_def(job_names(spec)["train"]).execute_in_process(
        instance=instance, partition_key=sweep["trials"][0]
    )
    assert result.success  # the TrainSpec it launched with (which refuses 'auto') was built
    meta = instance.get_latest_materialization_event(
        AssetKey(["test", "digits", "trial_model"])
    ).asset_materialization.metadata
    assert (meta["strategy"].value, meta["strategy_chosen_by"].value, meta["model_params"].value) == (
        "ddp",
        "planner",
        DIGITS_PARAMS,
    )
    assert meta["plan_reasoning"].value.startswith("ddp fits: 93.9 KiB of 14.4 GiB usable per device")
    assert (
        "| **ddp** (chosen) |" in meta["plan"].value and meta["device_memory_source"].value == f"{DEVICE_MEMORY_ENV}=16"
    )
    assert meta["lineage"].value["strategy"] == "ddp"


def test_count_classes_reads_the_target_column_without_pandas(tmp_path) -> None:
    """A run worker plans a trial without importing pandas: the classes of every split, one lacking a class, with
    pyarrow."""
    import pandas as pd

    for split, labels in {"train": [0, 2, 2, 5], "val": [1, 0], "test": [5]}.items():
        pd.DataFrame({"x": [0.5] * len(labels), "label": labels}).to_parquet(
            tmp_path / f"{split}.parquet"
        )  # with pandas metadata
    code = f"""
import sys
from types import SimpleNamespace
from resources.storage import ObjectStore
from trainyard.planner import count_classes
root = {str(tmp_path)!r}
uris = {{s: f"{{root}}/{{s}}.parquet" for s in ("train", "val", "test")}}
n = count_classes(SimpleNamespace(target="label"), uris, ObjectStore(root=root))
assert n == 4, n
assert "pandas" not in sys.modules, "pandas was imported"
"""
    subprocess.run([sys.executable, "-c", code], check=True)


def test_count_classes_counts_text_labels(tmp_path) -> None:
    """A "yes"/"no" or three-word target is counted as it is (it was cast to int, which failed every trial of a model
    taking n_classes)."""
    from types import SimpleNamespace

    import pandas as pd

    from resources.storage import ObjectStore
    from trainyard.planner import count_classes

    for split, labels in {
        "train": ["approved", "denied", "denied"],
        "val": ["fraud", None],
        "test": ["approved"],
    }.items():
        pd.DataFrame({"outcome": labels}).to_parquet(tmp_path / f"{split}.parquet")
    uris = {s: str(tmp_path / f"{s}.parquet") for s in ("train", "val", "test")}
    assert count_classes(SimpleNamespace(target="outcome"), uris, ObjectStore(root=str(tmp_path))) == 3


@pytest.mark.parametrize("team", ["vision", "tabular", "language", "platform", "commerce"])
def test_a_code_location_loads_without_pandas(team: str) -> None:
    """Every Dagster run worker and code server loads its location: pandas (0.4 s) is imported by the work that needs
    it."""
    code = f"import sys, pipelines.{team}.definitions; assert 'pandas' not in sys.modules, 'pandas was imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_planner_sizes_a_model_for_the_preprocessed_width() -> None:
    from tests.pipelines.pipeline_fixtures import small_spec
    from training.spec import Preprocessing
    from trainyard.planner import input_width_bound
    from trainyard.spec import ColumnSpec

    assert input_width_bound(small_spec()) == len(small_spec().features)  # numeric, complete: unchanged
    columns = {
        "plan": ColumnSpec(dtype="category", domain=["a", "b", "c"]),
        "country": ColumnSpec(dtype="str", nullable=True),
        "signup": ColumnSpec(dtype="date"),
        "seen": ColumnSpec(dtype="datetime"),
        "charges": ColumnSpec(dtype="float", nullable=True),
        "label": ColumnSpec(dtype="int", domain=[0, 1]),
    }
    spec = small_spec(columns=columns, preprocessing=Preprocessing(max_categories=20))
    # plan 3+1, country 20+1 and its indicator, signup 5 parts, seen 6 (the hour too), charges and its indicator
    assert input_width_bound(spec) == 4 + 22 + 5 + 6 + 2
    assert (
        input_width_bound(small_spec(columns=columns, preprocessing=Preprocessing(categorical="index")))
        == 1 + 2 + 5 + 6 + 2
    )
