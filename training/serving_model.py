"""MLflow pyfunc that serves a model exported by a training process.

This file is an MLflow "models from code" definition: `ModelRegistry.register`
passes its *path* to `mlflow.pyfunc.log_model`, MLflow copies it into the model
artifacts, and whoever loads the model executes it. It must therefore stay
self-contained and import only mlflow, numpy, pandas, the model's runtime
(torch or lightgbm, imported only for the format being served) and the
standard library, so a serving image needs none of trainyard or Dagster.

Preprocessing travels with the model: serving takes the raw columns. A model
whose `meta.json` names `"preprocessing": "preprocessing.json"` applies that
fitted state (`training/preprocessing.py`, shipped beside this file through the
MLflow model's `code_paths` and imported as `preprocessing`): categoricals
(unseen values are the "other" level), dates or ISO text, missing values. An
older model selects `meta["features"]` by name and casts them to its input
dtype. Extra columns are ignored and column order does not matter.

`predict` returns a DataFrame indexed like the input: the `meta["keep"]` columns
(ids, timestamps) the input holds, then `<target>` (the label, one of
`meta["classes"]` as the training data spelled it, or the regression value),
then for classification `proba_<label>` per class, its probability.

An image classifier (`meta["input_kind"] == "image"`) takes one column, `image`:
each row one image's values as they landed, flattened row-major from `meta["shape"]`
(`[H, W]` or `[H, W, C]`), within `meta["scale"]` (`[min, max]`), read as training
read them (`preprocessing.image_batch`); a row of another size or with a value out
of range is refused, naming the row. It returns `label` and `proba_<label>`.

A language model (task `causal_lm`, `CausalLM` in `training/serving_lm.py`, shipped
and imported like the preprocessing, as `serving_lm`) takes token ids: a DataFrame
with a `tokens` column of int lists (signature `tokens: Array(long)`), or on the
python model itself an int array `[N, T]`; it returns the last position's
next-token logits, float32 `[N, vocab_size]`, or with params
`{"output": "token_nll"}` each row's mean next-token loss, float64 `[N]`.
`generate(model_dir_or_uri, prompt, max_new_tokens)` continues a prompt greedily.

The exported model directory (the `model_dir` artifact) holds `meta.json`:
`{"format": ..., "features": [...], "target": "label", "task": ..., "classes": [...]}`
and one model file per format:

- `torch_export` (the default when `format` is absent): `model.pt2`, a
  `torch.export` ExportedProgram with a dynamic batch dimension, taking
  `input_dtype` (float32) `[batch, n_features]` and returning logits
  `[batch, n_classes]` (task `classification`) or one value per row,
  `[batch]` or `[batch, 1]` (task `regression`); for task `causal_lm` it takes
  int64 token ids `[batch, length]` (length dynamic up to `meta["block_size"]`)
  and returns logits `[batch, length, meta["vocab_size"]]`; meta also holds
  `eos_id` and `tokenizer` (a file name beside it, or null). An image model takes
  float32 `[batch, *meta["input_shape"]]` (`[C, H, W]`).
- `lightgbm`: `model.txt`, a LightGBM model holding the best iteration; task
  `classification` (binary: probability of `classes[1]`; multiclass: one
  probability per class) or `regression`.

Loading is safe against a tampered artifact: a `model.pt2` is checked before
`torch.export.load` sees it (`check_exported_program`): only the graph (JSON),
raw weight bytes and sample inputs that torch's weights-only unpickler accepts;
graph calls must be torch operators and shape expressions plain arithmetic.
Anything else raises `UnsafeModelError` naming the file, and nothing in it runs.
`model.txt` and `meta.json` are text.

Example:
    >>> import mlflow.pyfunc
    >>> model = mlflow.pyfunc.load_model("models:/vision.digits@champion")
    >>> served = model.predict(frame)  # frame holds the meta["features"] columns, raw
    >>> served[["customer_id", "churned", "proba_yes"]]
"""

from __future__ import annotations

import ast
import io
import json
import os
import re
import zipfile
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import mlflow
import mlflow.models
import numpy as np
import pandas as pd

# By name, not as `mlflow.pyfunc.X`: type checkers see that attribute as mlflow's lazy loader.
from mlflow.pyfunc import PythonModel, PythonModelContext

if TYPE_CHECKING:
    from training.serving_lm import CausalLM

META_FILE = "meta.json"
DEFAULT_FORMAT = "torch_export"
MODEL_FILES = {"torch_export": "model.pt2", "lightgbm": "model.txt"}
"""The model file of each serving format."""
SUPPORTED_TASKS = {
    "torch_export": ("classification", "regression", "causal_lm"),
    "lightgbm": ("classification", "regression"),
}
"""Serving signature per task: `classification` predicts one label of `classes` per row, `regression` one float per row,
`causal_lm` the next token's logits per row of token ids."""
SUPPORTED_INPUT_DTYPES = ("float32", "float64", "int64")
MODEL_FILE = MODEL_FILES[DEFAULT_FORMAT]
LIGHTGBM_FORMAT = "lightgbm"
LIGHTGBM_MODEL_FILE = MODEL_FILES[LIGHTGBM_FORMAT]
LIGHTGBM_TASKS = SUPPORTED_TASKS[LIGHTGBM_FORMAT]


def read_meta(model_dir: str) -> dict[str, Any]:
    """Reads and validates `meta.json` of an exported model directory.

    Args:
        model_dir: Directory holding `meta.json` and the model file of its format.

    Returns:
        The parsed metadata.

    Raises:
        ValueError: A field is missing or holds a value this pyfunc cannot serve.
    """
    path = os.path.join(model_dir, META_FILE)
    with open(path, encoding="utf-8") as f:
        meta = json.load(f)
    if not isinstance(meta, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(meta).__name__}")
    features = meta.get("features")
    if not isinstance(features, list) or not features or not all(isinstance(c, str) for c in features):
        raise ValueError(f"{path}: field 'features' must be a non-empty list of column names, got {features!r}")
    if len(set(features)) != len(features):
        raise ValueError(f"{path}: field 'features' has duplicate names: {features!r}")
    fmt = meta.get("format", DEFAULT_FORMAT)
    if fmt not in MODEL_FILES:
        raise ValueError(f"{path}: field 'format' is {fmt!r}; supported: {sorted(MODEL_FILES)}")
    task = meta.get("task")
    if task not in SUPPORTED_TASKS[fmt]:
        raise ValueError(f"{path}: field 'task' is {task!r}; format {fmt!r} supports {list(SUPPORTED_TASKS[fmt])}")
    classes = meta.get("classes")
    if task == "classification" and (not isinstance(classes, list) or len(classes) < 2):
        raise ValueError(f"{path}: field 'classes' must list at least two labels for classification, got {classes!r}")
    dtype = meta.get("input_dtype", "float32" if fmt == "torch_export" else "float64")
    if dtype not in SUPPORTED_INPUT_DTYPES:
        raise ValueError(f"{path}: field 'input_dtype' is {dtype!r}; supported: {list(SUPPORTED_INPUT_DTYPES)}")
    if task == "causal_lm":
        for field in ("vocab_size", "block_size"):
            if not isinstance(meta.get(field), int) or isinstance(meta.get(field), bool) or meta[field] < 1:
                raise ValueError(
                    f"{path}: field {field!r} must be a positive integer for task 'causal_lm', got {meta.get(field)!r}"
                )
    if meta.get("input_kind") == "image":
        _preprocessing_module().check_image_meta(meta, path)
    if not os.path.isfile(os.path.join(model_dir, MODEL_FILES[fmt])):
        raise ValueError(f"{model_dir}: format {fmt!r} needs {MODEL_FILES[fmt]!r}, which is missing")
    return meta


class ExportedModel(PythonModel):
    """Serves an exported torch or LightGBM model; predicts labels (or values) from a DataFrame."""

    def __init__(self) -> None:
        self._meta: Optional[dict[str, Any]] = None
        self._classes: Optional[np.ndarray] = None
        self._dtype: Any = np.float32
        self._predict_raw: Optional[Callable[[np.ndarray], np.ndarray]] = None
        self._state: Optional[dict[str, Any]] = None
        self._transform: Optional[Callable[..., Any]] = None
        self._lm: Optional[CausalLM] = None
        self._image_batch: Optional[Callable[..., np.ndarray]] = None

    def load_context(self, context: PythonModelContext) -> None:
        """Loads the model and its metadata from the `model_dir` artifact.

        Args:
            context: MLflow context; `context.artifacts["model_dir"]` is the local
                copy of the exported model directory.
        """
        self.load_dir(context.artifacts["model_dir"])

    def load_dir(self, model_dir: str) -> None:
        """Loads the model and its metadata from an exported model directory (what `load_context` does)."""
        meta = read_meta(model_dir)
        fmt = meta.get("format", DEFAULT_FORMAT)
        self._meta = meta
        self._classes = np.asarray(meta["classes"]) if meta["task"] == "classification" else None
        self._dtype = np.dtype(meta.get("input_dtype", "float32" if fmt == "torch_export" else "float64"))
        path = os.path.join(model_dir, MODEL_FILES[fmt])
        self._predict_raw = _load_torch_export(path) if fmt == "torch_export" else _load_lightgbm(path, meta)
        if meta["task"] == "causal_lm":
            self._lm = _shipped("serving_lm", "CausalLM").CausalLM(self._predict_raw, meta, model_dir)
        self._image_batch = _preprocessing_module().image_batch if meta.get("input_kind") == "image" else None
        if meta.get("preprocessing"):
            with open(os.path.join(model_dir, meta["preprocessing"]), encoding="utf-8") as f:
                self._state = json.load(f)
            self._transform = _preprocessing_module().transform

    def predict(
        self,
        context: PythonModelContext,
        model_input: pd.DataFrame,
        params: Optional[dict[str, Any]] = None,
    ) -> Any:
        """Predicts one label (classification, with each class's probability) or value (regression) per row;
        for a language model, the next token's logits (or each row's mean loss), see the module docstring.

        Args:
            context: MLflow context (unused; state is set by `load_context`).
            model_input: Rows to predict, raw (text, dates, gaps as the data has them);
                must hold every column in `meta["features"]`. Other columns are ignored.
                A language model's: a `tokens` column of token-id lists, or an int array `[N, T]`.
            params: A language model's `{"output": "next_token_logits" | "token_nll"}`; otherwise unused.

        Returns:
            A frame indexed like the input: the `meta["keep"]` columns the input holds,
            `<target>` (labels from `meta["classes"]`, or values), and for
            classification `proba_<label>` per class. A language model's: float32
            `[N, vocab_size]` logits, or float64 `[N]` mean losses.

        Raises:
            ValueError: Feature columns are missing or cannot be preprocessed, or the
                model's output does not match the number of classes; a language model's
                token ids outside the vocabulary or rows of a length it cannot read.
        """
        if self._meta is None or self._predict_raw is None:
            raise RuntimeError("ExportedModel.predict called before load_context")
        if self._lm is not None:
            return self._lm.predict(model_input, params)
        features = self._meta["features"]
        if not isinstance(model_input, pd.DataFrame):
            model_input = pd.DataFrame(model_input)
        missing = [c for c in features if c not in model_input.columns]
        if missing:
            raise ValueError(
                f"model input is missing feature columns {missing}; expected all of {features}, got "
                f"{list(model_input.columns)}"
            )
        if self._image_batch is not None:
            values = self._image_batch(model_input[features[0]], self._meta["shape"], *self._meta["scale"])
        elif self._state is not None and self._transform is not None:
            values = self._transform(model_input, self._state, self._dtype)[0]
        else:
            values = model_input[features].to_numpy(dtype=self._dtype, copy=True)
        raw = np.asarray(self._predict_raw(values))
        name = self._meta.get("target") or "prediction"
        out = pd.DataFrame(index=model_input.index)
        for column in self._meta.get("keep") or []:
            if column in model_input.columns and column != name:
                out[column] = model_input[column].to_numpy()
        if self._classes is None:
            out[name] = np.asarray(raw, dtype="float64").reshape(len(values))
            return out
        proba = class_probabilities(raw, len(self._classes), self._meta.get("format", DEFAULT_FORMAT))
        out[name] = self._classes[proba.argmax(axis=1)] if len(values) else self._classes[:0]
        for k, label in enumerate(self._classes.tolist()):
            out[f"proba_{label}"] = proba[:, k]
        return out

    def generate(self, prompt: str | Sequence[int], max_new_tokens: int = 32) -> str:
        """The greedy continuation of `prompt`, text or token ids (language models only; see `CausalLM.generate`)."""
        if self._lm is None:
            raise ValueError(
                f"generate needs a language model (task 'causal_lm'); this one is {(self._meta or {}).get('task')!r}"
            )
        return self._lm.generate(prompt, max_new_tokens)


def generate(model_dir_or_uri: str, prompt: str, max_new_tokens: int = 32) -> str:
    """The greedy continuation of `prompt` (the new text only; at most `max_new_tokens` tokens, fewer at
    end-of-document) by a language model: an exported model directory (`meta.json`, `model.pt2`,
    `tokenizer.json`) or anything `mlflow.pyfunc.load_model` loads. Needs serving dependencies only.

    Example:
        >>> generate("models:/language.corpus@champion", "def main(", max_new_tokens=20)  # doctest: +SKIP
    """
    if os.path.isfile(os.path.join(model_dir_or_uri, META_FILE)):
        model = ExportedModel()
        model.load_dir(model_dir_or_uri)
    else:
        import mlflow.pyfunc

        model = mlflow.pyfunc.load_model(model_dir_or_uri).unwrap_python_model()
    return model.generate(prompt, max_new_tokens)


def class_probabilities(raw: np.ndarray, n_classes: int, fmt: str) -> np.ndarray:
    """Probabilities `[n, n_classes]` from a model's output.

    LightGBM returns probabilities (binary: of `classes[1]`, one per row). A torch
    model returns logits: one per row for a binary target (sigmoid, the logit of
    `classes[1]`), else one per class (softmax).

    Raises:
        ValueError: the output's shape fits neither.
    """
    raw = np.asarray(raw, dtype="float64")
    if n_classes == 2 and (raw.ndim == 1 or (raw.ndim == 2 and raw.shape[1] == 1)):
        p1 = raw.reshape(-1) if fmt == LIGHTGBM_FORMAT else 1.0 / (1.0 + np.exp(-raw.reshape(-1)))
        return np.column_stack([1.0 - p1, p1])
    if raw.ndim == 2 and raw.shape[1] == n_classes:
        if fmt == LIGHTGBM_FORMAT:
            return raw
        shifted = np.exp(raw - raw.max(axis=1, keepdims=True))
        return shifted / shifted.sum(axis=1, keepdims=True)
    raise ValueError(
        f"model returned output of shape {tuple(raw.shape)}; expected [batch, {n_classes}] (or one value per row "
        f"for two classes) for {n_classes} classes"
    )


def _shipped(name: str, *attributes: str) -> Any:
    """`training/<name>.py`: shipped beside this file (`code_paths`), else the installed package's.

    The shipped copy is taken when it holds `attributes` (another top-level module of that name does not).
    """
    import importlib

    try:
        # By name: the top-level module exists only where MLflow put the model's code_paths on sys.path (a served
        # model); in a trainer image or a checkout it is `training.<name>`, below.
        shipped = importlib.import_module(name)
        if all(hasattr(shipped, a) for a in attributes):
            return shipped
    except ImportError:
        pass
    return importlib.import_module(f"training.{name}")


def _preprocessing_module() -> Any:
    """`training/preprocessing.py`: shipped beside this file (`code_paths`), else the installed package's."""
    return _shipped("preprocessing", "transform", "STATE_VERSION")


class UnsafeModelError(ValueError):
    """A model file holds pickled objects, compiled code or a graph that calls more than torch operators.

    It is refused before anything in it is deserialised; `torch.export.load`
    alone would unpickle parts of it (with `weights_only=False` as a fallback).
    """

    def __init__(self, path: str, detail: str) -> None:
        super().__init__(
            f"model file {path} was refused: {detail}. An exported model holds only a graph of torch operators, "
            "raw weights and plain sample inputs; this one was not written by trainyard or has been tampered with"
        )
        self.path = path
        self.detail = detail

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return (type(self), (self.path, self.detail))


# Members of a torch.export archive (under its one root folder) that hold data only; anything else
# (compiled AOTInductor code, pickled custom objects, extra files, legacy pickled weights) is refused.
_PT2_MEMBER = re.compile(
    r"archive_format|archive_version|byteorder|\.data/version|\.data/serialization_id|models/\w+\.json"
    r"|data/weights/\w+_weights_config\.json|data/weights/weight_\d+"
    r"|data/constants/\w+_constants_config\.json|data/constants/tensor_\d+|data/sample_inputs/\w+\.pt"
)
_RAW_TENSOR = re.compile(r"(weight|tensor)_\d+")
_OPERATOR = re.compile(
    r"torch\.ops\.(aten|prims|higher_order)\.[a-z_][a-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)?|torch\._?sym_[a-z_]+"
    r"|_operator\.(getitem|add|sub|mul|floordiv|truediv|mod|neg|pos|pow|abs|eq|ne|lt|le|gt|ge|and_|or_|not_)|math\.[a-z][a-z0-9_]*"
)
_SYMBOL = re.compile(r"[a-z]+\d+")
_SYMPY_NAMES = frozenset({
    "Symbol", "Integer", "Rational", "Float", "Mul", "Add", "Pow", "Max", "Min", "Abs", "Eq", "Ne", "Lt", "Le", "Gt",
    "Ge", "StrictLessThan", "StrictGreaterThan", "LessThan", "GreaterThan", "Equality", "Unequality", "And", "Or",
    "Not", "Piecewise", "ExprCondPair", "floor", "ceiling", "sqrt", "oo", "zoo", "nan", "true", "false", "True",
    "False", "None", "Infinity", "NegativeInfinity", "NaN", "BooleanTrue", "BooleanFalse", "Half", "One", "Zero",
    "NegativeOne",
})
_EXPR_NODES = (ast.Expression, ast.Call, ast.Name, ast.Load, ast.Constant, ast.keyword, ast.UnaryOp, ast.BinOp,
               ast.Compare, ast.BoolOp, ast.Tuple, ast.operator, ast.unaryop, ast.cmpop, ast.boolop)


def _check_expr(expr: str, path: str) -> None:
    """A symbolic shape expression (sympy evaluates it with `eval`): calls of sympy's own functions on numbers and names
    only."""
    import torch.utils._sympy.functions as shape_functions

    allowed = _SYMPY_NAMES | set(shape_functions.__all__)
    try:
        nodes = list(ast.walk(ast.parse(expr, mode="eval")))
    except SyntaxError:
        nodes = [ast.Pass()]
    for node in nodes:
        if (not isinstance(node, _EXPR_NODES) or (isinstance(node, ast.Call) and not isinstance(node.func, ast.Name))
                or (isinstance(node, ast.Name) and node.id not in allowed and not _SYMBOL.fullmatch(node.id))):
            raise UnsafeModelError(
                path, f"its graph holds the shape expression {expr[:200]!r}, which is more than arithmetic on sizes"
            )


def _check_graph(obj: Any, path: str) -> None:
    """Every call in the serialised program (nested graphs too) is a torch operator; every shape expression is
    arithmetic."""
    if isinstance(obj, list):
        for item in obj:
            _check_graph(item, path)
        return
    if not isinstance(obj, dict):
        return
    calls = [
        obj[k] for k in ("target", "as_operator") if isinstance(obj.get(k), str)
    ]  # a node's call, an operator argument
    for target in calls:
        if not _OPERATOR.fullmatch(target) or "__" in target:
            raise UnsafeModelError(path, f"its graph calls {target[:200]!r}, which is not a torch operator")
    if isinstance(obj.get("expr_str"), str):
        _check_expr(obj["expr_str"], path)
    if obj.get("guards_code"):  # unlifting the program would exec() them
        raise UnsafeModelError(
            path, f"its program holds guard code, which loading would execute: {str(obj['guards_code'])[:200]}"
        )
    for key, value in obj.items():
        if key == "range_constraints" and isinstance(value, dict):
            for expr in value:
                _check_expr(expr, path)
        if key != "metadata":  # stack traces and module names, kept as strings
            _check_graph(value, path)


def check_exported_program(data: bytes, path: str) -> None:
    """Refuse a `torch.export` archive unless loading it needs no unpickling of code and runs only torch operators.

    Args:
        data: The archive's bytes (the same bytes are then loaded, so nothing changes in between).
        path: Where they came from, for the error.

    Raises:
        UnsafeModelError: a member other than graph, raw weights and configs; a weight or
            constant stored pickled; sample inputs that torch's weights-only unpickler
            refuses; a graph call that is not a torch operator or a shape expression
            that is not arithmetic.
    """
    import torch

    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
    except zipfile.BadZipFile as e:
        raise UnsafeModelError(path, f"it is not a torch.export archive ({e})") from None
    names = [n for n in archive.namelist() if not n.endswith("/")]
    roots = {n.split("/", 1)[0] for n in names}
    if len(roots) != 1 or len(set(names)) != len(names) or any("/" not in n for n in names):
        raise UnsafeModelError(path, "it is not a torch.export archive with one root folder and unique members")
    for name in names:
        member = name.split("/", 1)[1]
        if not _PT2_MEMBER.fullmatch(member):
            raise UnsafeModelError(path, f"it holds {member!r}, which is neither graph, raw weights nor plain data")
        body = archive.read(name)
        if member.endswith("_config.json"):
            for fqn, entry in json.loads(body).get("config", {}).items():
                if entry.get("use_pickle") is not False or not _RAW_TENSOR.fullmatch(str(entry.get("path_name"))):
                    raise UnsafeModelError(path, f"{fqn!r} is stored as a pickle, not as raw tensor bytes")
        elif member.startswith("data/sample_inputs/"):
            try:  # any failure here would make torch.export.load retry with weights_only=False
                torch.load(io.BytesIO(body), map_location="cpu", weights_only=True)
            except Exception as e:
                found = re.search(r"^.*[Uu]nsupported.*$", str(e), re.MULTILINE)
                why = found.group(0).strip() if found else f"{type(e).__name__}: {str(e)[:200]}"
                raise UnsafeModelError(path, f"{member} holds pickled code or is not plain data ({why})") from None
        elif member.startswith("models/"):
            _check_graph(json.loads(body), path)


def _load_torch_export(path: str) -> Callable[[np.ndarray], np.ndarray]:
    import torch  # each runtime loads only for its own flavour: a LightGBM server needs no torch

    with open(path, "rb") as f:
        data = f.read()
    check_exported_program(data, path)
    module = torch.export.load(io.BytesIO(data)).module()

    def run(values: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return module(torch.from_numpy(values)).cpu().numpy()

    return run


def _load_lightgbm(path: str, meta: dict[str, Any]) -> Callable[[np.ndarray], np.ndarray]:
    import lightgbm  # each runtime loads only for its own flavour: a torch server needs no LightGBM

    booster = lightgbm.Booster(model_file=path)
    best = meta.get("best_iteration")

    def run(values: np.ndarray) -> np.ndarray:
        return np.asarray(booster.predict(values, num_iteration=best if best else None))

    return run


# Kept for versions logged before LightGBM support; the class is looked up by name only here.
ExportedClassifier = ExportedModel

mlflow.models.set_model(ExportedModel())
