#!/usr/bin/env bash
# `make kind-e2e`: the digits pipeline as a 2-node gang on a real Kubernetes cluster (kind),
# with the real JobSet and Kueue controllers and deploy/'s queues, priorities and RBAC.
#
# Needs a running Docker daemon, kind and kubectl, and the internet (base images, the
# JobSet and Kueue releases, PostgreSQL and MinIO images). Where no Docker daemon runs
# (as on the project's build machines and in CI) it prints why and exits 0: skipped.
#
# What it does (docs/kubernetes.md, "End to end on kind"):
#  1. builds the trainer image (CPU torch) and the orchestrator image, base pinned by digest;
#  2. creates the kind cluster of deploy/kind/cluster.yaml (two workers) and loads both images;
#  3. installs JobSet and Kueue (release manifests, versions below), then deploy/k8s
#     (namespaces, priority classes, Kueue queues and its configuration, RBAC);
#  4. starts PostgreSQL (Optuna, MLflow, Dagster's run storage) and MinIO (the object
#     store) as containers on the kind network, where pods and the orchestrator both
#     resolve them by name, and the team's Secret with their credentials;
#  5. runs deploy/kind/run_gang.py in the orchestrator image on the kind network:
#     prepare, one 2-node trial (a JobSet under Kueue), promote; exits with its status.
# KEEP=1 keeps the cluster and containers afterwards; `make kind-e2e-clean` removes them.
set -euo pipefail
cd "$(dirname "$0")/../.."

CLUSTER=trainyard-e2e
NETWORK=kind
JOBSET_VERSION="${JOBSET_VERSION:-v0.10.1}"  # >= v0.10: failurePolicy onJobFailureMessagePatterns (resources.k8s.manifests)
KUEUE_VERSION="${KUEUE_VERSION:-v0.13.4}"
TRAINER_IMAGE=trainyard/trainer:kind
ORCH_IMAGE=trainyard/orchestrator:kind
PG=trainyard-e2e-postgres
S3=trainyard-e2e-minio
NAMESPACE=vision                      # the vision team's namespace (deploy/k8s/00-namespaces.yaml)
PASSWORD="${TRAINYARD_E2E_PASSWORD:-e2e-$(date +%s)}"

skip() { echo "kind-e2e: skipped: $*"; exit 0; }
command -v docker >/dev/null 2>&1 || skip "no docker command"
docker info >/dev/null 2>&1 || skip "no Docker daemon answers (docker info failed)"
command -v kind >/dev/null 2>&1 || skip "no kind command (https://kind.sigs.k8s.io)"
command -v kubectl >/dev/null 2>&1 || skip "no kubectl command"

clean() {
  kind delete cluster --name "$CLUSTER" >/dev/null 2>&1 || true
  docker rm -f "$PG" "$S3" >/dev/null 2>&1 || true
}
if [[ "${1:-}" == "clean" ]]; then clean; echo "kind-e2e: removed"; exit 0; fi
[[ "${KEEP:-0}" == "1" ]] || trap clean EXIT

echo "== 1. images"
BASE_DIGEST="${BASE_DIGEST:-$(docker buildx imagetools inspect python:3.11-slim-bookworm --format '{{json .Manifest.Digest}}' | tr -d '"')}"
docker build -f deploy/docker/trainer.Dockerfile --build-arg BASE_DIGEST="$BASE_DIGEST" \
  --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu -t "$TRAINER_IMAGE" .
docker build -f deploy/docker/orchestrator.Dockerfile --build-arg BASE_DIGEST="$BASE_DIGEST" -t "$ORCH_IMAGE" .

echo "== 2. cluster"
kind get clusters | grep -qx "$CLUSTER" || kind create cluster --name "$CLUSTER" --config deploy/kind/cluster.yaml --wait 180s
kind load docker-image "$TRAINER_IMAGE" --name "$CLUSTER"
export KUBECONFIG="$(mktemp)"
kind get kubeconfig --name "$CLUSTER" > "$KUBECONFIG"

echo "== 3. JobSet $JOBSET_VERSION, Kueue $KUEUE_VERSION, deploy/k8s"
kubectl apply --server-side -f "https://github.com/kubernetes-sigs/jobset/releases/download/${JOBSET_VERSION}/manifests.yaml"
kubectl apply --server-side -f "https://github.com/kubernetes-sigs/kueue/releases/download/${KUEUE_VERSION}/manifests.yaml"
kubectl -n jobset-system rollout status deploy/jobset-controller-manager --timeout=300s
kubectl -n kueue-system rollout status deploy/kueue-controller-manager --timeout=300s
kubectl apply -f deploy/k8s/00-namespaces.yaml -f deploy/k8s/10-priority-classes.yaml
kubectl apply -f deploy/k8s/25-kueue-config.yaml            # waitForPodsReady, requeue with backoff
kubectl -n kueue-system rollout restart deploy/kueue-controller-manager
kubectl -n kueue-system rollout status deploy/kueue-controller-manager --timeout=300s
kubectl apply -f deploy/k8s/20-kueue.yaml -f deploy/k8s/30-rbac.yaml

echo "== 4. PostgreSQL and MinIO on the kind network"
docker rm -f "$PG" "$S3" >/dev/null 2>&1 || true
docker run -d --name "$PG" --network "$NETWORK" -e POSTGRES_PASSWORD="$PASSWORD" postgres:16
docker run -d --name "$S3" --network "$NETWORK" -e MINIO_ROOT_USER=trainyard -e MINIO_ROOT_PASSWORD="$PASSWORD" \
  minio/minio server /data
until docker exec "$PG" pg_isready -U postgres >/dev/null 2>&1; do sleep 1; done
for db in optuna mlflow dagster; do docker exec "$PG" createdb -U postgres "$db"; done
docker run --rm --network "$NETWORK" --entrypoint sh minio/mc -c \
  "mc alias set s3 http://$S3:9000 trainyard '$PASSWORD' && mc mb -p s3/trainyard"
OPTUNA_URL="postgresql://postgres:${PASSWORD}@${PG}:5432/optuna"
kubectl -n "$NAMESPACE" create secret generic trainyard-e2e --dry-run=client -o yaml \
  --from-literal=TRAINYARD_OPTUNA_URL="$OPTUNA_URL" \
  --from-literal=AWS_ACCESS_KEY_ID=trainyard --from-literal=AWS_SECRET_ACCESS_KEY="$PASSWORD" | kubectl apply -f -

echo "== 5. the digits pipeline as a 2-node gang"
INTERNAL="$(mktemp)"
kind get kubeconfig --name "$CLUSTER" --internal > "$INTERNAL"
mkdir -p .trainyard/kind-e2e
cat > .trainyard/kind-e2e/dagster.yaml <<YAML
storage:
  postgres:
    postgres_url: postgresql://postgres:${PASSWORD}@${PG}:5432/dagster
YAML
docker run --rm --network "$NETWORK" \
  -v "$INTERNAL:/kubeconfig:ro" -v "$PWD/deploy/kind/run_gang.py:/opt/trainyard/run_gang.py:ro" \
  -v "$PWD/.trainyard/kind-e2e/dagster.yaml:/opt/dagster/dagster_home/dagster.yaml:ro" \
  -e KUBECONFIG=/kubeconfig -e TRAINYARD_ENV=cluster \
  -e TRAINYARD_K8S_NAMESPACE="$NAMESPACE" -e TRAINYARD_TRAINER_IMAGE="$TRAINER_IMAGE" \
  -e TRAINYARD_K8S_SECRETS=trainyard-e2e -e TRAINYARD_K8S_GANG_KIND=jobset -e TRAINYARD_K8S_SERVICE_ACCOUNT=trainyard-trial \
  -e TRAINYARD_K8S_POD='{"cpu": "500m", "memory": "1Gi", "shm_size": "256Mi"}' \
  -e TRAINYARD_S3_ROOT=s3://trainyard/e2e -e AWS_ENDPOINT_URL="http://$S3:9000" \
  -e AWS_ACCESS_KEY_ID=trainyard -e AWS_SECRET_ACCESS_KEY="$PASSWORD" \
  -e TRAINYARD_OPTUNA_URL="$OPTUNA_URL" \
  -e MLFLOW_TRACKING_URI="postgresql://postgres@${PG}:5432/mlflow" -e PGPASSWORD="$PASSWORD" \
  -e WANDB_MODE=offline \
  "$ORCH_IMAGE" python run_gang.py
echo "kind-e2e: passed"
