# syntax=docker/dockerfile:1.7
# The trainer image: what every trial pod runs (`python -m torch.distributed.run ...
# -m training.entrypoint --spec <uri>`, from the Job manifest). It holds torch with
# CUDA, Lightning, the data and tracking libraries, `training/` and the teams' model
# code, and deliberately no Dagster: pods report through dagster-pipes, the
# protocol package, and the build fails if `dagster` is importable.
#
#   docker build -f deploy/docker/trainer.Dockerfile -t <registry>/trainyard/trainer:<tag> .
ARG PYTHON_VERSION=3.11
FROM python:${PYTHON_VERSION}-slim-bookworm

# CUDA wheels of torch bundle the CUDA runtime libraries; the node provides only
# the driver (NVIDIA device plugin). Pick the index matching the nodes' driver.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ARG TORCH_VERSION=2.13.0

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/home/trainer

WORKDIR /opt/trainyard

# The lock pins the CPU build of torch for the orchestrator; everything else in it
# applies here unchanged. Every training dependency, named one by one so Dagster
# never comes in: LightGBM for `task="gbt"` trials, Optuna (and the PostgreSQL
# driver of its storage) for trials of a sweep, tenacity for the checkpoint store's retries.
COPY constraints.txt ./
RUN grep -v '^torch==' constraints.txt > /tmp/constraints.trainer.txt \
 && pip install --index-url "$TORCH_INDEX_URL" "torch==${TORCH_VERSION}" \
 && pip install -c /tmp/constraints.trainer.txt \
      lightning torchmetrics numpy pandas pyarrow fsspec s3fs pydantic tenacity \
      lightgbm optuna psycopg2-binary \
      dagster-pipes wandb mlflow-skinny

# The pod side: the TrainSpec contract and entrypoint, and every team's model code
# (a spec names it by import path, anywhere under pipelines/). pipelines/ comes
# whole so no team's code is left out; its Dagster modules are never imported
# here, and tests/test_boundary.py imports every spec's model and data module
# with Dagster blocked.
COPY training/ training/
COPY pipelines/ pipelines/

RUN python -c "import importlib, pathlib, training.entrypoint, training.gbt, training.pruning; \
[importlib.import_module(f'pipelines.{p.parent.name}.models') for p in sorted(pathlib.Path('pipelines').glob('*/models.py'))]" \
 && if python -c "import dagster" 2>/dev/null; then echo "dagster must not be in the trainer image" >&2; exit 1; fi

RUN useradd --create-home --uid 10001 trainer
USER 10001
ENV PYTHONPATH=/opt/trainyard
# No ENTRYPOINT: the Job manifest gives the full torchrun command.
