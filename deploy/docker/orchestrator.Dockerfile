# syntax=docker/dockerfile:1.7
# The orchestrator image: Dagster, the team code locations, assets and resources.
# It runs each team's gRPC code server (dagster-user-deployments) and the run pods
# the K8sRunLauncher starts from it. Training never runs here: the Kubernetes
# launcher submits trials as Jobs of the trainer image.
#
#   docker build -f deploy/docker/orchestrator.Dockerfile -t <registry>/trainyard/orchestrator:<tag> .
ARG PYTHON_VERSION=3.11
FROM python:${PYTHON_VERSION}-slim-bookworm

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    DAGSTER_HOME=/opt/dagster/dagster_home \
    TRAINYARD_HOME=/tmp/trainyard \
    TRAINYARD_ENV=cluster

WORKDIR /opt/trainyard

# Dependencies first, from the lock, so code changes do not reinstall them. The
# lock pins the CPU build of torch (the orchestrator only loads models for the
# serving smoke test), hence the CPU wheel index.
COPY pyproject.toml constraints.txt README.md ./
RUN mkdir -p assets resources pipelines trainyard training \
 && touch assets/__init__.py resources/__init__.py pipelines/__init__.py trainyard/__init__.py training/__init__.py \
 && pip install --extra-index-url https://download.pytorch.org/whl/cpu -c constraints.txt . \
 && pip uninstall -y trainyard

COPY assets/ assets/
COPY resources/ resources/
COPY pipelines/ pipelines/
COPY trainyard/ trainyard/
COPY training/ training/
COPY workspace.yaml ./
RUN pip install --no-deps -c constraints.txt . \
 && python -c "import pipelines.vision.definitions"

# The chart mounts the instance config (dagster.yaml with PostgreSQL storage) into
# DAGSTER_HOME; the run pods and code servers need nothing else on disk.
RUN useradd --create-home --uid 10001 trainyard && mkdir -p "$DAGSTER_HOME" "$TRAINYARD_HOME" \
 && chown -R trainyard "$DAGSTER_HOME" "$TRAINYARD_HOME"
USER 10001
EXPOSE 3030
CMD ["dagster", "api", "grpc", "--module-name", "pipelines.vision.definitions", "--host", "0.0.0.0", "--port", "3030"]
