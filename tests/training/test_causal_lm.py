"""The causal_lm task: `DecoderLM` trained through the entrypoint, its metrics, its export, and serving it in a fresh
process.

One trial (`trained`, one process, in this one) memorises a repeated text
(`tests.support.lm_data`): its perplexity falls far below the train split's
unigram model; the exported model is logged as an MLflow pyfunc and served in
a fresh `python -I` process that cannot import trainyard, Lightning or the
other training-only packages, where it generates the memorised continuation
and scores the test split with `token_nll` to the pod's own `test_perplexity`.
The slow test trains the same model under FSDP2 in two processes.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch

from pipelines.language.models import DecoderLM, SequenceTransformer
from resources.launcher import LocalLauncher
from resources.registry.registration import CODE_PATHS, SERVING_MODEL_PATH
from resources.registry.serving import TRAINING_ONLY_MODULES
from resources.registry.smoke import SCRIPT as SMOKE_SCRIPT
from tests.support.lm_data import SENTENCES, TinyTextData, train_bpe
from training import entrypoint
from training.errors import ConfigError
from training.lightning_eval import check_output_fits_task, evaluate_lm, lm_metrics
from training.lightning_task import build
from training.serving_model import ExportedModel, generate, read_meta
from training.spec import EXIT_BAD_CONFIG, DataSpec, Distribution, ImportTarget, TrainResult, TrainSpec

BLOCK = 24
HPARAMS = {"width": 48, "blocks": 1, "heads": 4, "lr": 0.01}
PROMPT = "the quick brown"
CONTINUATION = " fox jumps over the lazy dog. pack my box"


def lm_spec(tmp: Path, **over: Any) -> TrainSpec:
    """A causal_lm trial of DecoderLM on `TinyTextData`, written to `tmp/spec.json`, output in `tmp/run`."""
    base: dict[str, Any] = dict(
        pipeline="language/tiny",
        trial_id="trial-0000",
        prediction_task="causal_lm",
        model=ImportTarget(path="pipelines.language.models:DecoderLM", kwargs=HPARAMS),
        datamodule=ImportTarget(
            path="tests.support.lm_data:TinyTextData", kwargs={"block_size": BLOCK, "workdir": str(tmp / "tokenizer")}
        ),
        data=DataSpec(
            train_uri="memory://train",
            val_uri="memory://val",
            test_uri="memory://test",
            features=["tokens"],
            target="tokens",
            version="0" * 32,
        ),
        output_uri=str(tmp / "run"),
        max_epochs=30,
        batch_size=16,
        monitor="val_loss",
        monitor_mode="min",
    )
    base.update(over)
    spec = TrainSpec(**base)
    (tmp / "spec.json").write_text(spec.to_json())
    return spec


def result_of(tmp: Path) -> TrainResult:
    return TrainResult.model_validate_json((tmp / "run" / "result.json").read_text())


def served_rows(dm: TinyTextData) -> np.ndarray:
    """The test split as the served model scores it: each sample's `block_size + 1` tokens."""
    return dm.rows["test"].numpy()




@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("causal-lm")
    lm_spec(tmp)
    assert entrypoint.main(["--spec", str(tmp / "spec.json")]) == 0
    return tmp


# -- the model and the platform's arguments -----------------------------------------------------


def test_decoder_is_causal_and_ties_its_head_on_request() -> None:
    torch.manual_seed(0)
    model = DecoderLM(vocab_size=50, block_size=8, width=16, heads=2, blocks=2).eval()
    x = torch.randint(0, 50, (3, 8))
    changed = x.clone()
    changed[:, 5:] = (changed[:, 5:] + 1) % 50
    with torch.no_grad():
        assert model(x).shape == (3, 8, 50)
        assert torch.equal(model(x)[:, :5], model(changed)[:, :5])  # no position sees a later token
        assert not torch.equal(model(x)[:, 5:], model(changed)[:, 5:])
    tied = DecoderLM(vocab_size=50, block_size=8, width=16, heads=2, tie_weights=True)
    assert tied.head.weight is tied.embed.weight
    assert len(list(model.fsdp_units())) == 2 and "blocks.*.attn.q" in model.tensor_parallel_plan()
    with pytest.raises(ValueError, match="vocab_size >= 2"):
        DecoderLM(vocab_size=1)


def test_the_platform_fills_vocab_size_and_block_size_unless_the_pipeline_sets_them(tmp_path: Path) -> None:
    model, dm = build(lm_spec(tmp_path))
    assert (model.hparams["vocab_size"], model.hparams["block_size"]) == (dm.vocab_size, BLOCK) == (257, BLOCK)
    model, _ = build(
        lm_spec(
            tmp_path,
            model=ImportTarget(path="pipelines.language.models:DecoderLM", kwargs={**HPARAMS, "block_size": 64}),
        )
    )
    assert model.hparams["block_size"] == 64
    check_output_fits_task(model, dm, lm_spec(tmp_path))  # logits [batch, length, vocab]: fits


def test_a_model_without_next_token_logits_fails_before_training(tmp_path: Path) -> None:
    spec = lm_spec(
        tmp_path,
        model=ImportTarget(
            path="pipelines.language.models:SequenceTransformer", kwargs={"n_features": BLOCK, "vocab": 257}
        ),
    )
    model, dm = build(spec)
    assert isinstance(model, SequenceTransformer)
    with pytest.raises(
        ConfigError,
        match=r"returns shape \[2, 4\] for token ids of shape \[2, 24\]; task 'causal_lm' needs next-token logits "
              r"\[2, 24, 257\]",
    ):
        check_output_fits_task(model, dm, spec)
    assert entrypoint.main(["--spec", str(tmp_path / "spec.json")]) == EXIT_BAD_CONFIG


def test_lm_metrics_are_token_weighted_whatever_the_batching() -> None:
    torch.manual_seed(0)
    dm = TinyTextData(block_size=BLOCK, batch_size=7)
    model = DecoderLM(vocab_size=dm.vocab_size, block_size=BLOCK, width=16, heads=2, blocks=1)
    metrics = lm_metrics(model, dm)
    rows = dm.rows["test"]
    with torch.no_grad():
        logits = model(rows[:, :-1])
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, dm.vocab_size).double(), rows[:, 1:].reshape(-1)
        ).item()
    assert metrics["test_loss"] == pytest.approx(loss, rel=1e-6)
    assert metrics["test_perplexity"] == pytest.approx(math.exp(loss), rel=1e-6)
    whole = evaluate_lm(model, [(rows[:, :-1], rows[:, 1:])])
    assert whole["tokens"] == rows[:, 1:].numel() and whole["nll"] / whole["tokens"] == pytest.approx(loss, rel=1e-6)
    counts = dm.train_token_counts().astype(np.float64) + 1
    unigram = -np.log(counts / counts.sum())[rows[:, 1:].numpy()].mean()
    assert metrics["baseline_test_perplexity"] == pytest.approx(math.exp(unigram), rel=1e-9)


def test_without_train_token_counts_the_baseline_is_left_out(caplog: pytest.LogCaptureFixture) -> None:
    dm = TinyTextData(block_size=BLOCK)
    dm.train_token_counts = lambda: None  # type: ignore[method-assign]
    metrics = lm_metrics(DecoderLM(vocab_size=257, block_size=BLOCK, width=16, heads=2, blocks=1), dm)
    assert set(metrics) == {"val_loss", "val_perplexity", "test_loss", "test_perplexity"}
    assert "no baseline_*_perplexity: data module TinyTextData gives no train_token_counts()" in caplog.text


# -- one trial, end to end -------------------------------------------------------------------------


def test_the_trial_memorises_the_text_far_below_the_unigram_baseline(trained: Path) -> None:
    result = result_of(trained)
    m = result.metrics
    assert set(m) == {
        f"{b}{s}_{n}" for b in ("", "baseline_") for s in ("val", "test") for n in ("loss", "perplexity")
    } | {"tokens_per_second"}
    assert m["val_perplexity"] == pytest.approx(math.exp(m["val_loss"]))
    assert m["val_perplexity"] < 1.5 < 20 < m["baseline_val_perplexity"]
    assert m["test_perplexity"] < m["baseline_test_perplexity"] / 10
    assert m["tokens_per_second"] == pytest.approx(result.train_samples * BLOCK / result.fit_seconds)
    assert result.best_metric == pytest.approx(
        m["val_loss"], rel=1e-5
    )  # the epoch's all-reduced val_loss is the whole split's
    meta = read_meta(str(trained / "run" / "model"))
    assert {k: meta[k] for k in ("task", "vocab_size", "block_size", "eos_id", "tokenizer", "input_dtype")} == {
        "task": "causal_lm",
        "vocab_size": 257,
        "block_size": BLOCK,
        "eos_id": 256,
        "tokenizer": "tokenizer.json",
        "input_dtype": "int64",
    }


def test_the_served_model_takes_token_ids_and_checks_them(trained: Path) -> None:
    model = ExportedModel()
    model.load_dir(str(trained / "run" / "model"))
    rows = served_rows(TinyTextData(block_size=BLOCK))
    logits = model.predict(None, rows)
    assert logits.shape == (len(rows), 257) and logits.dtype == np.float32
    framed = model.predict(None, pd.DataFrame({"tokens": [r.tolist() for r in rows]}))
    np.testing.assert_array_equal(framed, logits)  # a row of block_size + 1 is read by its last block_size tokens
    ragged = model.predict(None, pd.DataFrame({"tokens": [rows[0, :3].tolist(), rows[1].tolist()]}))
    np.testing.assert_allclose(ragged, model.predict(None, [rows[0, :3], rows[1]]), rtol=0, atol=0)
    nll = model.predict(None, rows, {"output": "token_nll"})
    assert nll.shape == (len(rows),) and nll.dtype == np.float64
    assert math.exp(nll.mean()) == pytest.approx(result_of(trained).metrics["test_perplexity"], rel=1e-4)
    with pytest.raises(ValueError, match=r"row 2: token id 257 is outside the vocabulary 0..256"):
        model.predict(None, [[1, 2], [3, 257]])
    with pytest.raises(ValueError, match=r"row 1 holds 26 tokens; this output reads 2 to 25 tokens \(block_size 24\)"):
        model.predict(None, [list(range(26))], {"output": "token_nll"})
    with pytest.raises(
        ValueError, match=r"params output='probabilities'; a language model serves \['next_token_logits', 'token_nll'\]"
    ):
        model.predict(None, rows, {"output": "probabilities"})
    with pytest.raises(ValueError, match="a DataFrame with a 'tokens' column"):
        model.predict(None, pd.DataFrame({"ids": [[1, 2]]}))
    assert generate(str(trained / "run" / "model"), PROMPT, len(CONTINUATION)).startswith(CONTINUATION)


CHILD = """
import importlib.util, json, sys
request = json.load(open(sys.argv[1]))
def load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
attempts = []
sys.meta_path.insert(0, load("smoke", request["smoke"]).ServingImageOnly(frozenset(request["blocked"]), attempts))
import mlflow.pyfunc
import pandas as pd
model = mlflow.pyfunc.load_model(request["model"])
rows = pd.DataFrame({"tokens": request["rows"]})
serving = load("serving_file", request["serving_file"])  # the file a serving image gets with the model
out = {
    "logits_shape": list(model.predict(rows).shape),
    "nll": model.predict(rows, params={"output": "token_nll"}).tolist(),
    "text": model.unwrap_python_model().generate(request["prompt"], request["n"]),
    "text_by_uri": serving.generate(request["model"], request["prompt"], request["n"]),
    "signature": model.metadata.signature.to_dict(),
    "blocked_imports": attempts,
    "loaded": sorted({m.split(".")[0] for m in sys.modules} & set(request["blocked"])),
}
json.dump(out, open(request["output"], "w"))
"""


@pytest.mark.slow
def test_exported_model_generates_and_scores_in_a_fresh_serving_only_process(trained: Path, tmp_path: Path) -> None:
    import mlflow.pyfunc

    rows = served_rows(TinyTextData(block_size=BLOCK))
    example = pd.DataFrame({"tokens": [r.tolist() for r in rows[:5]]})
    logged = tmp_path / "logged"
    # As registration logs a causal_lm version: the params in the example make MLflow record their schema.
    mlflow.pyfunc.save_model(
        str(logged),
        python_model=str(SERVING_MODEL_PATH),
        artifacts={"model_dir": str(trained / "run" / "model")},
        input_example=(example, {"output": "next_token_logits"}),
        code_paths=[str(path) for path in CODE_PATHS],
    )
    request = {
        "smoke": SMOKE_SCRIPT,
        "blocked": list(TRAINING_ONLY_MODULES),
        "model": str(logged),
        "rows": rows.tolist(),
        "serving_file": str(SERVING_MODEL_PATH),
        "prompt": PROMPT,
        "n": len(CONTINUATION),
        "output": str(tmp_path / "out.json"),
    }
    (tmp_path / "request.json").write_text(json.dumps(request))
    (tmp_path / "child.py").write_text(CHILD)
    done = subprocess.run(
        [sys.executable, "-I", str(tmp_path / "child.py"), str(tmp_path / "request.json")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["blocked_imports"] == [] and out["loaded"] == []
    assert out["logits_shape"] == [len(rows), 257]
    assert out["text"].startswith(CONTINUATION) and out["text_by_uri"] == out["text"]
    served = math.exp(float(np.mean(out["nll"])))
    assert served == pytest.approx(result_of(trained).metrics["test_perplexity"], rel=1e-4)
    signature = out["signature"]
    assert json.loads(signature["inputs"]) == [
        {"type": "array", "items": {"type": "long"}, "name": "tokens", "required": True}
    ]
    assert json.loads(signature["outputs"]) == [
        {"type": "tensor", "tensor-spec": {"dtype": "float32", "shape": [-1, 257]}}
    ]
    assert json.loads(signature["params"]) == [
        {"name": "output", "default": "next_token_logits", "shape": None, "type": "string"}
    ]


def test_a_bpe_tokenizer_travels_with_the_model(tmp_path: Path) -> None:
    tokenizer = train_bpe(tmp_path / "bpe.json")
    spec = lm_spec(
        tmp_path,
        max_epochs=1,
        limit_train_batches=2,
        datamodule=ImportTarget(
            path="tests.support.lm_data:TinyTextData", kwargs={"block_size": 8, "tokenizer_path": str(tokenizer)}
        ),
    )
    assert entrypoint.main(["--spec", str(tmp_path / "spec.json")]) == 0
    model_dir = Path(spec.output_uri) / "model"
    assert (model_dir / "tokenizer.json").read_bytes() == tokenizer.read_bytes()
    meta = read_meta(str(model_dir))
    assert (
        meta["vocab_size"] == TinyTextData(block_size=8, tokenizer_path=str(tokenizer)).vocab_size <= 300
        and meta["eos_id"] is not None
    )
    text = generate(str(model_dir), SENTENCES[0], 5)
    assert isinstance(text, str)  # an untrained model's words, decoded by the BPE
    from tokenizers import Tokenizer

    served = ExportedModel()
    served.load_dir(str(model_dir))
    assert (
        served.generate(Tokenizer.from_file(str(tokenizer)).encode(SENTENCES[0]).ids, 5) == text
    )  # ids as they are: the same
    with pytest.raises(ValueError, match="outside the vocabulary"):
        served.generate([10**6], 1)


# -- FSDP2 over two processes (slow) ------------------------------------------------------------------


@pytest.mark.slow
def test_fsdp_two_processes_train_the_same_model(tmp_path: Path, trained: Path) -> None:
    spec = lm_spec(tmp_path, batch_size=8, max_epochs=15, distribution=Distribution(procs_per_node=2, strategy="fsdp"))
    result = LocalLauncher(timeout_seconds=300).launch(spec).result
    assert result is not None and result.world_size == 2
    shards = sorted(p.name for p in next((tmp_path / "run" / "checkpoints").glob("step-*")).glob("shard-*.pt"))
    assert shards == ["shard-00000.pt", "shard-00001.pt"]
    m = result.metrics
    assert m["val_perplexity"] < m["baseline_val_perplexity"] / 5
    assert result.best_metric == pytest.approx(
        m["val_loss"], rel=1e-5
    )  # summed over both ranks, exactly the whole split's
    assert m["tokens_per_second"] == pytest.approx(result.train_samples * BLOCK / result.fit_seconds)
    assert result.train_samples == 15 * len(TinyTextData(block_size=BLOCK).rows["train"])
    served = ExportedModel()
    served.load_dir(str(tmp_path / "run" / "model"))
    nll = served.predict(None, served_rows(TinyTextData(block_size=BLOCK)), {"output": "token_nll"})
    assert math.exp(nll.mean()) == pytest.approx(m["test_perplexity"], rel=1e-4)
