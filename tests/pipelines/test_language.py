"""The language team's precedence pipeline: its data, its transformer, tensor parallel, and the whole chain.

Tensor parallel is checked against the unsharded model in two real gloo
processes: logits, and the gradients of the parameters that stay replicated,
agree to `TP_ATOL`, and so do the gradients of every parameter, sharded ones
gathered (float32; the only difference is the summation order of the split
matrix products and the rowwise all-reduces; measured: logits 9e-8, gradients 2e-8).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from dagster import AssetKey
from torch.nn import functional as F

from pipelines.catalog import workspace_teams
from pipelines.language.models import SequenceTransformer, check_heads_split
from pipelines.language.precedence import LENGTH, SIGNALS, TARGET, TOKENS, VOCAB, landing_frame, precedence
from tests.pipelines.pipeline_fixtures import Harness, write_landing
from training.spec import Distribution
from training.strategies import StrategyConfigError, check_model_supports

ROOT = Path(__file__).resolve().parents[2]
TP_ATOL = 1e-6
CHANCE = 1 / SIGNALS


def test_language_is_a_code_location_with_the_six_asset_chain() -> None:
    from pipelines.language.definitions import defs

    locations = {
        e["python_module"]["location_name"]: e["python_module"]["module_name"]
        for e in yaml.safe_load((ROOT / "workspace.yaml").read_text())["load_from"]
    }
    assert locations["language"] == "pipelines.language.definitions"
    names = ["raw_data", "validated_data", "sweep", "trial_model", "best_model", "registered_model"]
    assert {AssetKey(["language", "precedence", n]) for n in names} <= set(
        defs.resolve_asset_graph().get_all_asset_keys()
    )
    assert defs.get_assets_def(AssetKey(["language", "precedence", "trial_model"])).op.pool == "language_gpu"
    assert {t.name: t.gpu_pool_limit for t in workspace_teams()}["language"] == 2
    assert precedence.distribution == Distribution(procs_per_node=2, strategy="fsdp")
    assert (
        precedence.features == TOKENS and precedence.search.n_trials == 2 and precedence.promotion.metric == "test_acc"
    )


def test_landing_frame_is_deterministic_balanced_and_labelled_by_the_first_signal() -> None:
    frame = landing_frame()
    assert frame.equals(landing_frame()) and not frame.equals(landing_frame(seed=1))
    assert list(frame.columns) == [*TOKENS, TARGET] == list(precedence.columns)
    assert frame[TARGET].value_counts().sort_index().tolist() == [500] * SIGNALS
    assert not frame.duplicated().any() and len(frame) >= precedence.min_rows
    tokens = frame[TOKENS].to_numpy()
    assert tokens.min() == 0 and tokens.max() == VOCAB - 1
    for signal in range(SIGNALS):
        assert ((tokens == signal).sum(axis=1) == 1).all()  # every signal once in every row
    first_signal = tokens[np.arange(len(tokens)), np.argmax(tokens < SIGNALS, axis=1)]
    assert (first_signal == frame[TARGET].to_numpy()).all()


def _split(frame, train: int = 1400):
    x, y = frame[TOKENS].to_numpy(), frame[TARGET].to_numpy()
    return x[:train], y[:train], x[train:], y[train:]


def test_bag_of_words_is_at_chance() -> None:
    """The label is in the order of the tokens, not in which tokens occur: token counts predict at chance."""
    from sklearn.linear_model import LogisticRegression

    xtr, ytr, xte, yte = _split(landing_frame())

    def counts(x: np.ndarray) -> np.ndarray:
        return np.stack([np.bincount(row, minlength=VOCAB) for row in x])

    bag = LogisticRegression(max_iter=2000).fit(counts(xtr), ytr).score(counts(xte), yte)
    assert abs(bag - CHANCE) < 0.06, f"bag-of-words accuracy {bag:.3f} should be near chance {CHANCE}"


@pytest.mark.slow
@pytest.mark.extended(
    reason="covered in CI: test_tensor_parallel_training_through_torchrun_learns_the_order and "
    "test_fsdp_chain_registers_a_champion_well_above_chance train this transformer on the same "
    "landing frame (torchrun, tensor parallel; the pipeline's FSDP trials) and assert test_acc > 0.6"
)
def test_a_small_transformer_learns_the_order_in_one_process() -> None:
    xtr, ytr, xte, yte = _split(landing_frame())
    torch.manual_seed(0)
    model = SequenceTransformer(n_features=LENGTH, n_classes=SIGNALS, vocab=VOCAB, lr=5e-3)
    optimizer = model.configure_optimizers()
    x, y = torch.tensor(xtr, dtype=torch.float32), torch.tensor(ytr)
    order = torch.Generator().manual_seed(0)
    for _ in range(8):
        for idx in torch.randperm(len(x), generator=order).split(64):
            optimizer.zero_grad()
            F.cross_entropy(model(x[idx]), y[idx]).backward()
            optimizer.step()
    model.eval()
    with torch.no_grad():
        acc = float((model(torch.tensor(xte, dtype=torch.float32)).argmax(1) == torch.tensor(yte)).float().mean())
    assert acc > 0.6, f"transformer accuracy {acc:.3f} after 8 epochs; chance is {CHANCE}"


def test_forward_takes_float_token_ids_and_exports_with_a_dynamic_batch(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from training.data import read_parquet_tensors

    model = SequenceTransformer(n_features=LENGTH, n_classes=SIGNALS, vocab=VOCAB, blocks=2).eval()
    ids = torch.randint(0, VOCAB, (5, LENGTH))
    with torch.no_grad():
        logits = model(ids.float())
        assert logits.shape == (5, SIGNALS)
        assert torch.equal(logits, model(ids))
    # the example the platform exports with: the first rows of the training split as the Parquet reader returns it
    pq.write_table(pa.Table.from_pandas(landing_frame(400), preserve_index=False), tmp_path / "train.parquet")
    x, _ = read_parquet_tensors(str(tmp_path / "train.parquet"), TOKENS, TARGET)
    exported = torch.export.export(model, (x[:2],), dynamic_shapes=({0: torch.export.Dim("batch")},)).module()
    assert torch.allclose(exported(ids.float()), logits, atol=1e-6)


def test_the_model_supports_every_strategy() -> None:
    model = SequenceTransformer(blocks=2)
    for dist in (
        Distribution(procs_per_node=2),
        Distribution(procs_per_node=2, strategy="fsdp"),
        Distribution(procs_per_node=4, strategy="tp", tensor_parallel_size=4),
    ):
        check_model_supports(model, dist)
    assert model.fsdp_units() == list(model.blocks)


def test_heads_must_split_evenly_over_tensor_parallel_ranks() -> None:
    check_heads_split(4, 2)
    check_heads_split(4, 4)
    with pytest.raises(
        StrategyConfigError,
        match=r"heads=4 cannot be split over tensor_parallel_size=8: each rank needs whole heads; use a "
              r"tensor_parallel_size in \[1, 2, 4\]",
    ):
        check_heads_split(4, 8)


# --- tensor parallel: two real gloo processes -------------------------------------------------


def _tp_worker(rank: int, world: int, tmp: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = SequenceTransformer(n_features=LENGTH, n_classes=SIGNALS, vocab=VOCAB, width=32, heads=4, blocks=2)
        frame = landing_frame(64)
        x, y = torch.tensor(frame[TOKENS].to_numpy(), dtype=torch.float32), torch.tensor(frame[TARGET].to_numpy())
        want = model(x)
        F.cross_entropy(want, y).backward()
        reference = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad()

        parallelize_module(
            model, init_device_mesh("cpu", (world,), mesh_dim_names=("tensor_parallel",)), model.tensor_parallel_plan()
        )
        q = model.blocks[0].attn.q.weight
        got = model(x)
        F.cross_entropy(got, y).backward()
        grads = {
            n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for n, p in model.named_parameters()
        }
        out = {
            "q_local_shape": list(q.to_local().shape),
            "logits_diff": float((got - want).detach().abs().max()),
            "grad_diff": max(float((grads[n] - g).abs().max()) for n, g in reference.items()),
            "logits_scale": float(want.detach().abs().max()),
        }
        Path(tmp, f"rank-{rank}.json").write_text(json.dumps(out))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_tensor_parallel_forward_and_backward_match_the_unsharded_model(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    mp.spawn(_tp_worker, args=(2, str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        out = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        assert out["q_local_shape"] == [16, 32]  # 2 of the 4 heads on each rank
        assert out["logits_diff"] <= TP_ATOL, out
        assert out["grad_diff"] <= TP_ATOL, out
        assert out["logits_scale"] > 0.01  # not a vacuous comparison


@pytest.mark.slow
def test_tensor_parallel_training_through_torchrun_learns_the_order(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from resources.launcher import LocalLauncher
    from training.spec import DataSpec, ImportTarget, TrainSpec

    frame = landing_frame().astype({t: "float64" for t in TOKENS})  # as validated_data writes it
    uris = {}
    for split, rows in {"train": frame.iloc[:1400], "val": frame.iloc[1400:1700], "test": frame.iloc[1700:]}.items():
        uris[split] = str(tmp_path / f"{split}.parquet")
        pq.write_table(pa.Table.from_pandas(rows, preserve_index=False), uris[split])
    spec = TrainSpec(
        pipeline="language/precedence",
        trial_id="trial-0000",
        model=ImportTarget(path="pipelines.language.models:SequenceTransformer", kwargs={"vocab": VOCAB, "lr": 5e-3}),
        data=DataSpec(
            train_uri=uris["train"],
            val_uri=uris["val"],
            test_uri=uris["test"],
            features=TOKENS,
            target=TARGET,
            version="0" * 32,
        ),
        output_uri=str(tmp_path / "run"),
        max_epochs=8,
        batch_size=64,
        distribution=Distribution(procs_per_node=2, strategy="tp", tensor_parallel_size=2),
    )
    result = LocalLauncher(timeout_seconds=300).launch(spec).result
    assert result.world_size == 2 and result.metrics["test_acc"] > 0.6, result.metrics
    exported = torch.export.load(str(tmp_path / "run" / "model" / "model.pt2")).module()
    test = frame.iloc[1700:]
    predicted = exported(torch.tensor(test[TOKENS].to_numpy(), dtype=torch.float32)).argmax(1).numpy()
    assert (predicted == test[TARGET].to_numpy()).mean() == pytest.approx(result.metrics["test_acc"], abs=1e-6)


# --- the whole chain: prepare -> 2 FSDP trials (torchrun, 2 CPU processes each) -> promote ---------


@pytest.mark.slow
def test_fsdp_chain_registers_a_champion_well_above_chance(tmp_path: Path) -> None:
    import pandas as pd

    write_landing(tmp_path, landing_frame(), prefix=precedence.source.prefix)
    harness = Harness(tmp_path, precedence)
    out = harness.run_all()
    assert out["sweep"]["trials"] == ["trial-0000", "trial-0001"]
    best = out["best"]
    assert best["world_size"] == 2
    assert best["metrics"]["test_acc"] > 0.6, f"test accuracy {best['metrics']['test_acc']:.3f}; chance is {CHANCE}"
    assert out["registered"]["created"] and out["registered"]["champion"]
    registry = harness.resources["registry"]
    champion = registry.get_alias("language.precedence", "champion")
    assert champion is not None and champion.version == out["registered"]["version"]
    assert champion.tags["trainyard.model"] == "pipelines.language.models:SequenceTransformer"
    # the exported model serves float token rows and scores what training measured
    split = f"{best['lineage']['data_version']}-{precedence.fingerprint()}"
    test_df = pd.read_parquet(
        harness.resources["store"].uri("data", "language", "precedence", "validated", split, "test.parquet")
    )
    assert registry.evaluate_accuracy(champion.model_uri, test_df, TARGET) == pytest.approx(
        best["metrics"]["test_acc"], abs=1e-6
    )
