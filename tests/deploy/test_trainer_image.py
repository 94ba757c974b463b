"""The trainer image runs every team's trials, from one declared requirement set.

deploy/docker/trainer-requirements.txt is that set: the trainer Dockerfile installs
exactly it (under constraints.txt), and these tests hold it to the code:

- every third-party package the pod side imports (all of `training/`, the module of
  every `ModelSpec.path` and datamodule of every team, and whatever first-party code
  they import in turn, found with `ast`) is declared, and every first-party module
  among them is copied into the image;
- every base image is pinned by digest;
- (slow) the declared set, installed with `pip -r ... -c constraints.txt` into a fresh
  venv as the Dockerfile does (torch's CPU build here, the same version), has no
  Dagster, imports every model and datamodule, and trains one step of every pipeline
  through `torchrun ... -m training.entrypoint`, the pod's command, in the pipeline's
  Optuna study, reporting through Dagster Pipes and tracked by W&B (offline).

The built venv is cached under ~/.cache/trainyard-trainer-venv (or
$TRAINYARD_TRAINER_VENV_CACHE), keyed by the hash of the requirement set, the lock
and the interpreter, so only the first run (and CI's clean clone) pays for the build.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib.metadata import packages_distributions
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Optional

import pytest
from packaging.utils import canonicalize_name

if TYPE_CHECKING:
    from trainyard.spec import ColumnSpec, PipelineSpec
    from trainyard.values import ValidatedData

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "deploy" / "docker"
TRAINER_DOCKERFILE = DOCKER / "trainer.Dockerfile"
REQUIREMENTS = DOCKER / "trainer-requirements.txt"
CONSTRAINTS = ROOT / "constraints.txt"
VENV_CACHE_ENV = "TRAINYARD_TRAINER_VENV_CACHE"
BUILT = "trainyard-built.json"  # written last into a cached venv: it is complete
# Dagster's protocol package for external processes: it does not depend on dagster.
ALLOWED_DAGSTER = {"dagster-pipes"}


def first_party(root: Path = ROOT) -> set[str]:
    """The repository's top-level packages (pyproject's `packages.find` include list)."""
    include = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    return {pattern.rstrip("*") for pattern in include}


def declared_requirements(path: Path = REQUIREMENTS) -> list[str]:
    """The distribution names of the trainer's requirement file, canonical, in file order (names only: the lock pins
    them)."""
    names = []
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", line):
            raise ValueError(
                f"{path.name}:{number}: {line!r} is not a bare distribution name; versions belong in constraints.txt"
            )
        names.append(canonicalize_name(line))
    return names


def locked_versions(path: Path = CONSTRAINTS) -> dict[str, str]:
    """The lock's exact pins, by canonical name."""
    pins = {}
    for raw in path.read_text().splitlines():
        name, sep, version = raw.split("#", 1)[0].strip().partition("==")
        if sep:
            pins[canonicalize_name(name.split("[")[0])] = version.strip()
    return pins


# -- the Dockerfiles, read as Docker reads them ------------------------------------------------


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined and comments dropped."""
    out, buffer = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            buffer += line[:-1] + " "
            continue
        keyword, _, args = (buffer + line).partition(" ")
        out.append((keyword.upper(), args.strip()))
        buffer = ""
    return out


def copies(path: Path) -> list[tuple[list[str], str]]:
    """(sources, destination) of each COPY instruction that copies from the build context (not from another stage)."""
    found = []
    for keyword, args in instructions(path):
        words = args.split()
        if keyword == "COPY" and not any(w.startswith("--from") for w in words):
            *sources, dest = [w for w in words if not w.startswith("--")]
            found.append((sources, dest))
    return found


def copied_sources(path: Path) -> list[str]:
    """What the Dockerfile copies from the build context, without trailing '/'."""
    return [src.rstrip("/") for sources, _ in copies(path) for src in sources]


_OPTIONS_WITH_VALUE = {
    "-r",
    "--requirement",
    "-c",
    "--constraint",
    "-i",
    "--index-url",
    "--extra-index-url",
    "-f",
    "--find-links",
}


def pip_installs(path: Path) -> list[tuple[dict[str, list[str]], list[str]]]:
    """Each `pip install` of the Dockerfile's RUN instructions: (options with their values, positional requirements)."""
    found = []
    for keyword, args in instructions(path):
        if keyword != "RUN":
            continue
        for command in re.split(r"&&|;|\|\|", args):
            words = command.split()
            if words[:2] != ["pip", "install"]:
                continue
            options: dict[str, list[str]] = {}
            positional: list[str] = []
            rest = iter(words[2:])
            for word in rest:
                if word in _OPTIONS_WITH_VALUE:
                    options.setdefault(word, []).append(next(rest, ""))
                elif word.startswith("-"):
                    options.setdefault(word, [])
                else:
                    positional.append(word.strip("\"'"))
            found.append((options, positional))
    return found


# A base image is `name:tag@sha256:<digest>`, or the digest comes from a build argument that
# stops the build when it is missing (`${ARG:?message}`: never an empty, unpinned reference).
_PINNED_FROM = re.compile(r"^[\w./-]+:[\w.-]+@(?:sha256:[0-9a-f]{64}|\$\{(?P<arg>\w+):\?[^}\s]+\})$")


def unpinned_bases(path: Path) -> list[str]:
    """FROM lines of the Dockerfile whose base image is not pinned by digest (a stage built earlier in it is fine)."""
    stages: set[str] = set()
    meta_args: dict[str, Optional[str]] = {}  # ARGs before the first FROM: the only ones FROM can use
    bad, in_stage = [], False
    for keyword, args in instructions(path):
        if keyword == "ARG" and not in_stage:
            name, sep, default = args.partition("=")
            meta_args[name.strip()] = default.strip() if sep else None
        if keyword != "FROM":
            continue
        in_stage = True
        words = [w for w in args.split() if not w.startswith("--platform")]
        image = words[0]
        if image in stages:
            continue
        if len(words) == 3 and words[1].upper() == "AS":
            stages.add(words[2])
        match = _PINNED_FROM.match(image)
        arg = match and match.group("arg")
        if not match:
            bad.append(f"{path.name}: FROM {image} (pin it: name:tag@sha256:<digest>)")
        elif arg and arg not in meta_args:
            bad.append(f"{path.name}: FROM {image}: no ARG {arg} before the first FROM")
        elif arg and meta_args[arg] is not None and not re.fullmatch(r"sha256:[0-9a-f]{64}", meta_args[arg] or ""):
            bad.append(f"{path.name}: ARG {arg}={meta_args[arg]} is not a digest (sha256:<64 hex>)")
    return bad


# -- what the pod side imports -------------------------------------------------------------------


@dataclass
class PodSide:
    """The first-party modules the pod side loads, and the third-party packages they import."""

    modules: dict[str, Path] = field(default_factory=dict)
    third_party: dict[str, list[str]] = field(default_factory=dict)  # top-level package -> where ("file:line")
    unresolved: list[str] = field(default_factory=list)  # first-party imports with no module file


def _module_file(root: Path, module: str) -> Optional[Path]:
    base = root.joinpath(*module.split("."))
    return next((p for p in (base.with_suffix(".py"), base / "__init__.py") if p.is_file()), None)


def _imports(path: Path, module: str) -> Iterator[tuple[int, str, bool]]:
    """(line, absolute module name, must exist) of every import in `path`, also inside functions and TYPE_CHECKING
    blocks.

    `from a import b` yields `a` (must exist) and `a.b` (a submodule, or just a name in `a`).
    """
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, a.name, True) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, *([node.module] if node.module else [])])
            else:
                base = node.module or ""
            yield node.lineno, base, True
            yield from ((node.lineno, f"{base}.{a.name}", False) for a in node.names if a.name != "*")


def pod_side(roots: Iterable[str], root: Path = ROOT) -> PodSide:
    """Follow the imports of the modules `roots` (and of their parent packages) through first-party code.

    Import targets of specs are `module:attr`; a target in a third-party module (`lightgbm:train`) counts as an import
    of it.
    """
    ours = first_party(root)
    found = PodSide()
    queue = [r.partition(":")[0] for r in roots]
    for target in queue:
        if target.split(".")[0] not in ours:
            found.third_party.setdefault(target.split(".")[0], []).append(f"a spec's import path ({target})")
    queue = [m for m in queue if m.split(".")[0] in ours]
    while queue:
        module = queue.pop()
        if module in found.modules:
            continue
        path = _module_file(root, module)
        if path is None:
            found.unresolved.append(module)
            continue
        found.modules[module] = path
        parts = module.split(".")
        queue += [".".join(parts[:i]) for i in range(1, len(parts))]
        for line, name, must_exist in _imports(path, module):
            top = name.split(".")[0]
            if top in ours:
                if must_exist or _module_file(root, name) is not None:
                    queue.append(name)
            elif top != "__future__" and top not in sys.stdlib_module_names:
                where = found.third_party.setdefault(top, [])
                if f"{path.relative_to(root)}:{line}" not in where:
                    where.append(f"{path.relative_to(root)}:{line}")
    return found


def training_modules(root: Path = ROOT) -> list[str]:
    """Every module of the `training` package: the image runs the entrypoint, which may load any of them."""
    return sorted(
        ".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        for p in (root / "training").rglob("*.py")
    )


def undeclared(
    found: PodSide, declared: Iterable[str], providers: Optional[dict[str, list[str]]] = None
) -> dict[str, str]:
    """Third-party packages the pod side imports that no declared distribution provides: package -> why, with where."""
    providers = packages_distributions() if providers is None else providers
    wanted = set(declared)
    bad = {}
    for top, where in sorted(found.third_party.items()):
        dists = {canonicalize_name(d) for d in providers.get(top, [])}
        if not dists & wanted:
            by = f"provided by {sorted(dists)}" if dists else "no installed distribution provides it"
            bad[top] = f"{by}; imported at {', '.join(where[:3])}"
    return bad


def not_copied(found: PodSide, sources: Iterable[str], root: Path = ROOT) -> list[str]:
    """First-party modules the pod side loads that the Dockerfile's COPY instructions leave out."""
    copied = [root / s for s in sources]
    return sorted(m for m, p in found.modules.items() if not any(p == c or c in p.parents for c in copied))


def pod_side_of_every_pipeline() -> tuple[dict[str, PipelineSpec], PodSide]:
    from tests.test_boundary import pod_side_specs

    specs = pod_side_specs()
    targets = [t for spec in specs.values() for t in (spec.model.path, spec.model.datamodule)]
    return specs, pod_side([*training_modules(), *targets])


# -- fast tests ----------------------------------------------------------------------------------


def test_pod_side_imports_only_declared_packages_and_copied_code() -> None:
    specs, found = pod_side_of_every_pipeline()
    assert {"vision/digits", "tabular/breast_cancer", "language/precedence"} <= set(specs)
    assert {"pipelines.language.models", "pipelines.vision.models", "training.entrypoint", "training.gbt"} <= set(
        found.modules
    )
    assert {"torch", "lightning", "lightgbm", "optuna", "wandb", "dagster_pipes"} <= set(found.third_party)
    assert found.unresolved == []
    assert undeclared(found, declared_requirements()) == {}
    assert not_copied(found, copied_sources(TRAINER_DOCKERFILE)) == []


def test_declared_set_is_locked_and_free_of_dagster() -> None:
    declared = declared_requirements()
    assert len(declared) == len(set(declared)), "a requirement is listed twice"
    pins = locked_versions()
    assert [name for name in declared if name not in pins] == [], "pin every trainer requirement in constraints.txt"
    assert [n for n in declared if n.startswith("dagster") and n not in ALLOWED_DAGSTER] == []


def test_trainer_dockerfile_installs_exactly_the_declared_set() -> None:
    sources = copied_sources(TRAINER_DOCKERFILE)
    assert {str(REQUIREMENTS.relative_to(ROOT)), CONSTRAINTS.name, "training", "pipelines"} <= set(sources)
    installs = pip_installs(TRAINER_DOCKERFILE)
    from_file = [opts for opts, _ in installs if opts.get("-r") == [REQUIREMENTS.name]]
    assert len(from_file) == 1 and from_file[0].get("-c"), "one `pip install -r trainer-requirements.txt -c <lock>`"
    # Nothing is named inline but torch's CUDA build and the torchvision built with it (litdata requires it),
    # each at the lock's version, from TORCH_INDEX_URL.
    inline = [req for _, positional in installs for req in positional]
    assert inline and all(re.fullmatch(r"torch(vision)?==\$\{?TORCH(VISION)?_VERSION\}?", req) for req in inline), (
        inline
    )
    assert len(inline) == 2, inline


def test_every_base_image_is_pinned_by_digest() -> None:
    dockerfiles = sorted(DOCKER.glob("*.Dockerfile"))
    assert {p.name for p in dockerfiles} >= {"trainer.Dockerfile", "orchestrator.Dockerfile"}
    assert [line for p in dockerfiles for line in unpinned_bases(p)] == []


def test_the_checks_catch_what_they_look_for(tmp_path: Path) -> None:
    (tmp_path / "pyproject.toml").write_text('[tool.setuptools.packages.find]\ninclude = ["training*", "trainyard*"]\n')
    for package, files in {
        "training": {
            "__init__.py": "",
            "a.py": "import sklearn\nfrom . import b\n",
            "b.py": "import lightgbm\nfrom trainyard.x import y\n",
        },
        "trainyard": {"__init__.py": "", "x.py": "import yaml\nfrom .z import w\n"},
    }.items():
        (tmp_path / package).mkdir()
        for name, text in files.items():
            (tmp_path / package / name).write_text(text)
    found = pod_side(["training.a"], root=tmp_path)
    assert sorted(found.modules) == ["training", "training.a", "training.b", "trainyard", "trainyard.x"]
    assert found.unresolved == ["trainyard.z"]
    providers = {"sklearn": ["scikit-learn"], "lightgbm": ["lightgbm"], "yaml": ["PyYAML"]}
    assert sorted(undeclared(found, ["lightgbm"], providers)) == ["sklearn", "yaml"]
    assert not_copied(found, ["training"], root=tmp_path) == ["trainyard", "trainyard.x"]
    dockerfile = tmp_path / "x.Dockerfile"
    dockerfile.write_text(
        "ARG PY=3.11\nFROM python:${PY}-slim\nFROM python:3.11-slim@${D}\nARG D\nFROM python:3.11-slim@sha256:"
        + "a" * 64
        + " AS ok\nFROM ok\n"
    )
    assert [line.split(": ", 1)[1] for line in unpinned_bases(dockerfile)] == [
        "FROM python:${PY}-slim (pin it: name:tag@sha256:<digest>)",
        "FROM python:3.11-slim@${D} (pin it: name:tag@sha256:<digest>)",
    ]
    dockerfile.write_text("ARG D=latest\nFROM python:3.11-slim@${D:?set_D}\n")
    assert unpinned_bases(dockerfile) == ["x.Dockerfile: ARG D=latest is not a digest (sha256:<64 hex>)"]
    (tmp_path / "reqs.txt").write_text("torch\nlightgbm>=4\n")
    with pytest.raises(ValueError, match=r"reqs.txt:2: 'lightgbm>=4' is not a bare distribution name"):
        declared_requirements(tmp_path / "reqs.txt")


# -- the trainer environment, built as the Dockerfile builds it ------------------------------------


def venv_key() -> str:
    """What the trainer venv is built from: the requirement set, the lock, the interpreter and the machine."""
    digest = hashlib.sha256()
    recipe = b"litdata --no-deps"  # how `trainer_venv` installs them: change it when that changes
    for part in (
        REQUIREMENTS.read_bytes(),
        CONSTRAINTS.read_bytes(),
        sys.version.encode(),
        platform.machine().encode(),
        recipe,
    ):
        digest.update(hashlib.sha256(part).digest())
    return digest.hexdigest()[:16]


def _outside_environ() -> dict[str, str]:
    """This process's environment without what points into the test's own venv."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}


def trainer_venv() -> tuple[Path, Optional[float]]:
    """The trainer's Python environment and the seconds its build took (None: from the cache).

    A fresh venv, then `pip install -r trainer-requirements.txt -c constraints.txt` from
    the package index, as the Dockerfile installs them (the lock's torch is the CPU build,
    from local disk here; litdata without its requirements, see below). Built once per `venv_key` under a file lock; one
    left half-built
    is built again, and other keys' venvs unused for a day are removed.
    """
    from filelock import FileLock

    cache = Path(os.environ.get(VENV_CACHE_ENV) or Path.home() / ".cache" / "trainyard-trainer-venv")
    cache.mkdir(parents=True, exist_ok=True)
    venv = cache / venv_key()
    built = venv / BUILT
    with FileLock(str(cache / ".lock"), timeout=3600):
        if built.is_file():
            built.touch()  # in use: not pruned
            return venv, None
        torch = locked_versions().get("torch", "")
        assert torch.endswith("+cpu"), (
            f"constraints.txt pins torch {torch!r}, not a CPU build: this test never installs a CUDA build"
        )
        shutil.rmtree(venv, ignore_errors=True)
        start = time.monotonic()
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300, env=_outside_environ())
        log = venv / "trainyard-pip.log"
        with log.open("w") as out:
            # --no-compile: pip byte-compiles every installed module (torch's thousands) otherwise, most of the
            # build's time; the trials below compile what they import. What installs, and from where, is the same.
            # The image installs torchvision (litdata's requirement) from TORCH_INDEX_URL beside torch's CUDA build; the
            # package index's torchvision is a CUDA build that breaks `import lightning` on the CPU torch here, and no
            # CPU
            # build of it is on disk, so litdata comes in as `make install` brings it: without its requirements.
            requirements = venv / "trainer-requirements.txt"
            requirements.write_text(
                "".join(
                    line for line in REQUIREMENTS.read_text().splitlines(keepends=True) if line.strip() != "litdata"
                )
            )
            python = [str(venv / "bin" / "python"), "-m", "pip", "install", "--no-input", "--no-compile"]
            code = subprocess.run(
                [*python, "-r", str(requirements), "-c", str(CONSTRAINTS)],
                env=_outside_environ(),
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=3000,
            ).returncode
            if code == 0:
                code = subprocess.run(
                    [*python, "--no-deps", "litdata", "-c", str(CONSTRAINTS)],
                    env=_outside_environ(),
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    timeout=600,
                ).returncode
        assert code == 0, f"pip could not install the trainer requirements (log: {log}):\n{log.read_text()[-4000:]}"
        seconds = time.monotonic() - start
        built.write_text(json.dumps({"seconds": round(seconds, 1), "requirements": declared_requirements()}))
        for other in cache.iterdir():  # only venvs of other keys (names like ours), unused for a day
            used = other / BUILT if (other / BUILT).is_file() else other
            if (
                re.fullmatch(r"[0-9a-f]{16}", other.name)
                and other != venv
                and time.time() - used.stat().st_mtime > 86400
            ):
                shutil.rmtree(other, ignore_errors=True)
    return venv, seconds


def lay_out_app(dockerfile: Path, app: Path) -> None:
    """Copy into `app` (the image's WORKDIR) what the Dockerfile's COPY instructions copy, where they put it."""
    for sources, dest in copies(dockerfile):
        for src in sources:
            source, target = ROOT / src.rstrip("/"), app / dest
            if source.is_dir():  # Docker copies a directory's contents
                shutil.copytree(source, target, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                target.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, target / source.name)


# Run by the trainer venv's interpreter in the laid-out app: no Dagster, which distributions,
# torch's build, and every model, datamodule and `training` module imported.
_CHECK_SCRIPT = """
import importlib, json, pkgutil, sys
from importlib import metadata
report = {"failures": {}}
try:
    import dagster
    report["dagster"] = dagster.__file__
except ModuleNotFoundError:
    report["dagster"] = None
report["distributions"] = sorted({d.metadata["Name"] for d in metadata.distributions()})
import torch
report["torch"], report["cuda"] = torch.__version__, torch.version.cuda
import training
modules = [m.name + ":__name__" for m in pkgutil.walk_packages(training.__path__, "training.")]
for target in json.loads(sys.argv[1]) + modules:
    module, _, attr = target.partition(":")
    try:
        getattr(importlib.import_module(module), attr)
    except Exception as e:
        report["failures"][target] = f"{type(e).__name__}: {e}"
import fsspec
fsspec.get_filesystem_class("s3")  # s3fs, never imported by name
import psycopg2  # Optuna's PostgreSQL storage
report["imported"] = sorted(m for m in sys.modules if "." not in m)
print(json.dumps(report))
"""


def pod_environ(venv: Path, app: Path, home: Path, **extra: str) -> dict[str, str]:
    """A pod's environment: the venv's interpreter, the image's PYTHONPATH and nothing of this test process."""
    return {
        "PATH": f"{venv / 'bin'}:/usr/local/bin:/usr/bin:/bin", "HOME": str(home), "PYTHONPATH": str(app),
        "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true", "TMPDIR": str(home), **extra,
    }


def column_values(column: ColumnSpec, rows: int, rng: Any) -> Any:
    """`rows` values a column declared like `column` accepts (every value of its domain, cycled)."""
    import numpy as np

    if column.domain is not None:
        return rng.permutation(np.resize(np.array(column.domain), rows))
    low = column.min if column.min is not None else 0
    high = column.max if column.max is not None else low + 10
    if column.dtype == "float":
        return rng.uniform(low, high, rows)
    if column.dtype == "int":
        return rng.integers(int(low), int(high) + 1, rows)
    if column.dtype == "bool":
        return rng.integers(0, 2, rows).astype(bool)
    return np.array(["a", "b", "c"])[rng.integers(0, 3, rows)]


def write_split(spec: PipelineSpec, directory: Path, rows: int = 240) -> ValidatedData:
    """A train/val/test split of `rows` synthetic rows of the pipeline's declared columns, as `validated_data` points to
    one."""
    import numpy as np
    import pandas as pd

    from trainyard.values import ValidatedData

    if spec.shards is not None:
        return write_shard_split(spec, directory)
    rng = np.random.default_rng(0)
    frame = pd.DataFrame({name: column_values(column, rows, rng) for name, column in spec.columns.items()})
    directory.mkdir(parents=True)
    cuts = {"train": (0, int(rows * 0.7)), "val": (int(rows * 0.7), int(rows * 0.85)), "test": (int(rows * 0.85), rows)}
    for part, (start, stop) in cuts.items():
        frame.iloc[start:stop].to_parquet(directory / f"{part}.parquet", index=False)
    md5 = hashlib.md5((directory / "train.parquet").read_bytes()).hexdigest()
    return ValidatedData(md5=md5, split_id="synthetic", rows={p: b - a for p, (a, b) in cuts.items()},
                         **{part: str(directory / f"{part}.parquet") for part in cuts})


def write_shard_split(spec: PipelineSpec, directory: Path) -> ValidatedData:
    """A sharded pipeline's train/val/test splits (litdata chunks and meta.json, as `validated_data` points to them):
    random documents over the pipeline's vocabulary, or random images of its shape and labels."""
    from tests.support.shards import write_splits
    from trainyard.shardspec import TextShards
    from trainyard.values import ValidatedData

    shards = spec.shards
    assert shards is not None
    if isinstance(shards, TextShards):
        paths = write_splits(
            str(directory),
            "text",
            n_docs=40,
            vocab_size=shards.vocabulary,
            block_size=shards.block_size,
            doc_tokens=(shards.block_size, 4 * shards.block_size),
            chunk_bytes=1 << 16,
        )
    else:
        assert shards.labels == list(range(10)) and (shards.min, shards.max) == (0, 255), (
            "write_image_split writes labels 0..9, 0..255"
        )
        paths = write_splits(str(directory), "image", n=120, digits=False, shape=tuple(shards.shape))
    rows = {split: json.loads((Path(path) / "meta.json").read_text())["items"] for split, path in paths.items()}
    md5 = hashlib.md5(json.dumps(rows, sort_keys=True).encode()).hexdigest()
    return ValidatedData(md5=md5, split_id="synthetic", rows=rows, **paths)


@dataclass
class TrialRun:
    """How one trial's launch went: torchrun's exit status and output, and what the pod wrote and sent."""

    returncode: int
    log: str
    result: Any  # TrainResult, or None
    failures: list[dict[str, Any]]
    messages: list[dict[str, Any]]  # what rank 0 sent through Dagster Pipes
    tracker_dir: Path
    world_size: int


def run_trial(spec: PipelineSpec, venv: Path, app: Path, work: Path) -> TrialRun:
    """One trial of `spec`, one training step long, as the orchestrator launches it and a pod runs it.

    The orchestrator's side runs here with its own code: the sweep's study and trial
    (`SweepStore`), the capacity plan, `build_train_spec`, the spec file and torchrun's
    command line (`resources.launcher`); the pod's side runs in the trainer venv.
    """
    import pandas as pd
    from dagster_pipes import encode_env_var

    from resources.launcher import prepare_output, read_failures, read_result, torchrun_command
    from resources.model_facts import describe_model
    from resources.sweeps import SweepStore
    from resources.sweeps.rules import study_directions
    from training.spec import LAUNCH_ID_ENV, TrackerSpec, TrainSpec
    from trainyard.planner import plan_trial
    from trainyard.trainspec import TrialInputs, build_train_spec, model_kwargs

    data = write_split(spec, work / "data")
    sweeps = SweepStore(storage_url=f"sqlite:///{work / 'optuna.db'}")
    study_name = f"{spec.team}-{spec.name}"
    study = sweeps.load_or_create(study_name, study_directions(spec), spec.search)
    number = sweeps.ask(study, spec.search, 1)[0]
    trial = TrialInputs("trial-0000", number, study_name, sweeps.trial(study_name, number).params)
    if spec.shards is not None:
        classes = len(getattr(spec.shards, "labels", []))  # a language model has none
    else:
        classes = int(pd.read_parquet(data.train, columns=[spec.target])[spec.target].nunique())
    plan = plan_trial(spec, model_kwargs(spec, trial.params), lambda: classes, describe=describe_model)
    assert plan.error is None, f"{spec.key}: {plan.error}"
    tracker = TrackerSpec(
        kind="wandb",
        mode="offline",
        project=f"{spec.team}-{spec.name}",
        group=study_name,
        name=trial.trial_id,
        dir=str(work / "wandb"),
    )
    built = build_train_spec(
        spec,
        trial,
        data,
        output_uri=str(work / "run"),
        distribution=plan.distribution.model_copy(update={"max_restarts": 0}),
        tracker=tracker,
        optuna_storage_url=sweeps.storage_url,
        lineage={"test": "trainer image"},
        max_epochs=1,
    )
    train_spec = TrainSpec.model_validate({**built.model_dump(), "limit_train_batches": 1})
    spec_uri = str(work / "run" / "spec.json")
    prepare_output(train_spec, spec_uri)
    (work / "wandb").mkdir()
    pipes_context = {
        "asset_keys": [f"{spec.team}/{spec.name}/trial_model"],
        "code_version_by_asset_key": None,
        "provenance_by_asset_key": None,
        "partition_key": trial.trial_id,
        "partition_key_range": None,
        "partition_time_window": None,
        "run_id": "trainer-image-test",
        "job_name": None,
        "retry_number": 0,
        "extras": {},
    }
    messages = work / "pipes-messages.jsonl"
    environ = pod_environ(
        venv,
        app,
        work,
        **{LAUNCH_ID_ENV: "trainer-image-test"},
        **sweeps.pod_environment(),
        DAGSTER_PIPES_CONTEXT=encode_env_var({"data": pipes_context}),
        DAGSTER_PIPES_MESSAGES=encode_env_var({"path": str(messages)}),
    )
    command = torchrun_command(train_spec, spec_uri, python=str(venv / "bin" / "python"))
    proc = subprocess.run(command, cwd=app, env=environ, capture_output=True, text=True, timeout=900)
    sent = [json.loads(line) for line in messages.read_text().splitlines()] if messages.is_file() else []
    return TrialRun(proc.returncode, (proc.stdout + proc.stderr)[-6000:], read_result(train_spec.output_uri),
                    read_failures(train_spec.output_uri), sent, work / "wandb", train_spec.distribution.world_size)


def trial_problems(key: str, run: TrialRun) -> list[str]:
    """What is wrong with a one-step trial run (nothing when it trained, reported and tracked)."""
    if run.returncode != 0 or run.result is None:
        return [f"{key}: exit {run.returncode}, failures {run.failures}\n{run.log}"]
    problems = []
    if (run.result.global_step, run.result.world_size) != (1, run.world_size):
        problems.append(
            f"{key}: trained {run.result.global_step} steps on {run.result.world_size} processes, not 1 on "
            f"{run.world_size}"
        )
    methods = [m["method"] for m in run.messages]
    progress = [
        m["params"]["payload"]
        for m in run.messages
        if m["method"] == "report_custom_message" and m["params"]["payload"].get("type") == "progress"
    ]
    if methods[:1] != ["opened"] or methods[-1:] != ["closed"] or not progress or progress[-1]["step"] != 1:
        problems.append(f"{key}: Dagster Pipes got {methods}, progress {progress}")
    if not run.result.tracker_run or not list(run.tracker_dir.glob("**/offline-run-*")):
        problems.append(f"{key}: no offline W&B run (tracker_run={run.result.tracker_run!r})")
    return problems


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_trainer_environment_imports_and_trains_every_pipeline(tmp_path: Path) -> None:
    specs, found = pod_side_of_every_pipeline()
    venv, build_seconds = trainer_venv()
    print(
        f"trainer venv {venv}: "
        + (f"built in {build_seconds:.0f} s" if build_seconds is not None else "from the cache")
    )
    app = tmp_path / "opt-trainyard"
    lay_out_app(TRAINER_DOCKERFILE, app)
    # Every model and datamodule, and every third-party package the pod side imports (many only inside functions).
    targets = sorted(
        {t for spec in specs.values() for t in (spec.model.path, spec.model.datamodule)}
        | {f"{top}:__name__" for top in found.third_party}
    )
    (tmp_path / "home").mkdir()
    check = subprocess.run([str(venv / "bin" / "python"), "-c", _CHECK_SCRIPT, json.dumps(targets)], cwd=app,
                           env=pod_environ(venv, app, tmp_path / "home"), capture_output=True, text=True, timeout=600)
    assert check.returncode == 0, check.stderr[-4000:]
    report = json.loads(check.stdout.strip().splitlines()[-1])
    assert report["dagster"] is None and report["failures"] == {}, report
    installed = {canonicalize_name(n) for n in report["distributions"]}
    assert set(declared_requirements()) <= installed
    assert sorted(n for n in installed if n.startswith("dagster") and n not in ALLOWED_DAGSTER) == []
    # The lock's CPU build of torch: this machine has no GPU, and a CUDA build would download gigabytes.
    assert report["torch"] == locked_versions()["torch"] and report["cuda"] is None, (report["torch"], report["cuda"])
    assert sorted(n for n in installed if n.startswith("nvidia-")) == []
    assert {"dagster_pipes", "lightgbm", "lightning", "mlflow", "optuna", "s3fs", "wandb", "psycopg2"} <= set(
        report["imported"]
    )

    # The pipelines' trials side by side, as a cluster would run them: most of each is start-up.
    def one(key: str, spec: PipelineSpec) -> list[str]:
        start = time.monotonic()
        work = tmp_path / key.replace("/", "-")
        work.mkdir()
        found = trial_problems(key, run_trial(spec, venv, app, work))
        print(f"{key}: one step in {time.monotonic() - start:.0f} s")
        return found

    with ThreadPoolExecutor(max_workers=len(specs)) as pool:
        problems = [p for found in pool.map(one, specs.keys(), specs.values()) for p in found]
    assert problems == []
