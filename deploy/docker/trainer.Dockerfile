# syntax=docker/dockerfile:1.7
# The trainer image: what every trial pod runs (`python -m training.gang ...
# -m training.entrypoint --spec <uri>`, from the Job manifest), for every team: torch
# with CUDA, the requirements of deploy/docker/trainer-requirements.txt at the versions
# of constraints.txt, `training/` and every team's model code, and deliberately no
# Dagster: pods report through dagster-pipes, the protocol package, and the build
# fails if `dagster` is importable. tests/deploy/test_trainer_image.py builds the
# same requirement set in a venv and trains one step of every pipeline in it.
#
#   docker build -f deploy/docker/trainer.Dockerfile --build-arg BASE_DIGEST=sha256:<digest> \
#     -t <registry>/trainyard/trainer:<tag> .

# The base image, pinned by digest: a tag is moved by every rebuild of the image
# upstream, a digest names one image, so a commit always builds on the same base.
# No digest is committed (none was verified from this repository's build machines),
# so the build stops right here until you pass one. To get or update it (one digest
# for all platforms; the orchestrator image uses the same base):
#   docker buildx imagetools inspect python:3.11-slim-bookworm --format '{{json .Manifest.Digest}}'
# then build with --build-arg BASE_DIGEST=sha256:... (docs/kubernetes.md, "The trainer image").
ARG BASE_DIGEST
FROM python:3.11-slim-bookworm@${BASE_DIGEST:?pass_--build-arg_BASE_DIGEST=sha256:...(see_the_comment_above_FROM)}

# CUDA wheels of torch bundle the CUDA runtime libraries; the node provides only
# the driver (NVIDIA device plugin). Pick the index matching the nodes' driver.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/home/trainer

WORKDIR /opt/trainyard

# Dependencies first, so code changes do not reinstall them. The lock pins torch's
# CPU build (`torch==X+cpu`, for the orchestrator); here torch is the CUDA build of
# the same version X from TORCH_INDEX_URL, so the lock's torch line loses its local
# label and every other pin applies unchanged. The requirement set is the declared
# one, never a list typed here: Dagster cannot come in by accident.
COPY constraints.txt deploy/docker/trainer-requirements.txt ./
RUN TORCH_VERSION="$(sed -n 's/^torch==\([^+]*\).*$/\1/p' constraints.txt)" \
 && if [ -z "$TORCH_VERSION" ]; then echo "constraints.txt pins no torch version" >&2; exit 1; fi \
 && sed 's/^torch==\([^+]*\)+.*$/torch==\1/' constraints.txt > /tmp/constraints.trainer.txt \
 && TORCHVISION_VERSION="$(sed -n 's/^torchvision==\(.*\)$/\1/p' constraints.txt)" \
 && pip install --index-url "$TORCH_INDEX_URL" "torch==${TORCH_VERSION}" "torchvision==${TORCHVISION_VERSION}" \
 && pip install -r trainer-requirements.txt -c /tmp/constraints.trainer.txt \
 && pip check

# The pod side: the TrainSpec contract and entrypoint, the shared utilities it
# imports (common/, below training/ in the layers), and every team's
# model code (a spec names it by import path, anywhere under pipelines/). pipelines/
# comes whole so no team's code is left out; its Dagster modules are never imported here.
# tests/deploy/test_trainer_image.py checks that everything the pod side imports
# is copied here or declared in trainer-requirements.txt.
COPY common/ common/
COPY training/ training/
COPY pipelines/ pipelines/

RUN python -c "import importlib, pathlib, common.settings, training.entrypoint, training.lightning_task, training.gbt, training.pruning, training.reporting; \
import fsspec, psycopg2, wandb, mlflow.pyfunc, dagster_pipes; fsspec.get_filesystem_class('s3'); \
[importlib.import_module(f'pipelines.{p.parent.name}.models') for p in sorted(pathlib.Path('pipelines').glob('*/models.py'))]" \
 && if python -c "import dagster" 2>/dev/null; then echo "dagster must not be in the trainer image" >&2; exit 1; fi

RUN useradd --create-home --uid 10001 trainer
USER 10001
ENV PYTHONPATH=/opt/trainyard
# No ENTRYPOINT: the Job manifest gives the full torchrun command.
