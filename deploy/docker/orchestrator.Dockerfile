# syntax=docker/dockerfile:1.7
# The orchestrator image: Dagster, the team code locations, assets and resources.
# It runs each team's gRPC code server (dagster-user-deployments), the run pods
# the K8sRunLauncher starts from it, and the chart's webserver and daemon (their
# run queue is instance.run_queue.RunQueue). Training never runs here: the Kubernetes
# launcher submits trials as Jobs of the trainer image. Feature-store sources retrieve
# here, in the Feast interpreter (/opt/feast, its own lock: docs/data.md).
#
#   docker build -f deploy/docker/orchestrator.Dockerfile --build-arg BASE_DIGEST=sha256:<digest> \
#     -t <registry>/trainyard/orchestrator:<tag> .

# The base image, pinned by digest, the same as the trainer image's (see the comment
# above its FROM): the build stops here until you pass one. To get or update it:
#   docker buildx imagetools inspect python:3.11-slim-bookworm --format '{{json .Manifest.Digest}}'
ARG BASE_DIGEST
FROM python:3.11-slim-bookworm@${BASE_DIGEST:?pass_--build-arg_BASE_DIGEST=sha256:...(see_the_comment_above_FROM)}

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    DAGSTER_HOME=/opt/dagster/dagster_home \
    TRAINYARD_HOME=/tmp/trainyard \
    TRAINYARD_ENV=cluster \
    TRAINYARD_PROJECT_DIR=/opt/trainyard \
    TRAINYARD_FEAST_PYTHON=/opt/feast/bin/python

WORKDIR /opt/trainyard

# The Feast interpreter, as `make install` makes .venv-feast: Feast needs pandas<3, which
# the platform's lock does not allow, so it gets its own venv and lock. It imports only
# the platform's featurestore package (trainyard.data.feast.run_featurestore).
COPY deploy/feast/requirements.in deploy/feast/constraints.txt /tmp/feast/
RUN python -m venv /opt/feast \
 && /opt/feast/bin/pip install -c /tmp/feast/constraints.txt -r /tmp/feast/requirements.in \
 && /opt/feast/bin/python -c "import feast"

# Dependencies first, from the lock, so code changes do not reinstall them. The
# lock pins the CPU build of torch (the orchestrator only loads models for the
# serving smoke test), hence the CPU wheel index.
COPY pyproject.toml constraints.txt README.md ./
RUN mkdir -p assets resources instance pipelines trainyard training common featurestore \
 && touch assets/__init__.py resources/__init__.py instance/__init__.py pipelines/__init__.py trainyard/__init__.py \
    training/__init__.py common/__init__.py featurestore/__init__.py \
 && pip install --extra-index-url https://download.pytorch.org/whl/cpu -c constraints.txt . \
 && pip install --no-deps -c constraints.txt litdata \
 && pip uninstall -y trainyard

COPY assets/ assets/
COPY resources/ resources/
COPY instance/ instance/
COPY pipelines/ pipelines/
COPY trainyard/ trainyard/
COPY training/ training/
COPY common/ common/
COPY featurestore/ featurestore/
COPY workspace.yaml ./
# The project directory (TRAINYARD_PROJECT_DIR, trainyard/project.py) holds workspace.yaml and
# constraints.txt; the packages are imported from site-packages, where the wheel put them.
# The check imports from there (-P: not from the copies here) and runs featurestore in the Feast
# interpreter, which answers a request that is not JSON with its own refusal.
RUN pip install --no-deps -c constraints.txt . \
 && python -P -c "import pipelines.vision.definitions, trainyard.data.feast as f; \
p = f.run_featurestore('retrieve', input='not json', timeout_s=120); \
assert p.returncode == 2 and 'not JSON' in p.stdout, p.stdout + p.stderr"

# The lineage the promotion gate reads (docs/serving.md, "Clean lineage"): the image has
# no .git, so the build says which commit it is and whether the tree was dirty, e.g.
#   --build-arg TRAINYARD_CODE_VERSION=$(git rev-parse HEAD)$(git diff --quiet HEAD || echo -dirty)
# and the deployed lock is the constraints.txt copied above. Without the argument every
# version trained from this image records an unknown commit, which the cluster's
# default policy refuses to promote.
ARG TRAINYARD_CODE_VERSION=unknown
ENV TRAINYARD_CODE_VERSION=${TRAINYARD_CODE_VERSION} \
    TRAINYARD_LOCK_FILE=/opt/trainyard/constraints.txt

# The chart mounts the instance config (dagster.yaml with PostgreSQL storage) into
# DAGSTER_HOME; the run pods and code servers need nothing else on disk.
RUN useradd --create-home --uid 10001 trainyard && mkdir -p "$DAGSTER_HOME" "$TRAINYARD_HOME" \
 && chown -R trainyard "$DAGSTER_HOME" "$TRAINYARD_HOME"
USER 10001
EXPOSE 3030
CMD ["dagster", "api", "grpc", "--module-name", "pipelines.vision.definitions", "--host", "0.0.0.0", "--port", "3030"]
