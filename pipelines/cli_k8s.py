"""`trainyard k8s`: what a trial submits to Kubernetes, for review and GitOps.

    trainyard k8s render vision/digits                        # trial 0: its JobSet (the launcher's default kind)
    trainyard k8s render vision/digits --trial 3 --kind job   # as an Indexed Job and its Service
    trainyard k8s render vision/digits --data-version <md5> > trial-0000.yaml
    trainyard k8s gc --namespace vision --namespace language  # delete gangs whose Dagster run has ended
    trainyard k8s gc --dry-run                                # TRAINYARD_K8S_NAMESPACE; print only

`render` prints, as multi-document YAML, exactly the objects one attempt of a
trial submits: the Kubernetes launcher's own builder
(`KubernetesLauncher.trial_objects`), called on the launcher of the team's
`cluster` environment, which is configured as a trial's is: the platform's
`TRAINYARD_K8S_*` variables and `TRAINYARD_TRAINER_IMAGE`, with the team's
`TeamSpec` (namespace, queue, priority class, pod settings over
`TRAINYARD_K8S_POD`) laid on top (`TeamSpec.environment`). The cluster
environment's variables must be set as for a run (`TRAINYARD_S3_ROOT`, ...);
nothing is sent to the cluster.

The trial's directory (the spec URI every pod reads) depends on the data
version the sweep trains on: by default the pipeline's newest accepted version
in the environment's object store, or `--data-version`. Only the pipeline,
trial, directory and distribution (nodes, processes per node, accelerator,
restarts) reach the objects; the trial's sampled hyperparameters and data
files go into its `spec.json`, which the pods read.

`trainyard --help` imports this module to build its parser, so everything
beyond the standard library is imported inside the command.

`gc` deletes the unfinished gangs (JobSet, or Job and Service) whose Dagster run has
ended: each object carries its run id as the label `trainyard.io/dagster-run`,
and the Dagster instance (`DAGSTER_HOME`) says whether that run is still going
(`resources.k8s.gangs.collect_garbage`). A gang of a run the instance does not
know is deleted too. Cluster access: `--api-url`, else in-cluster, else kubeconfig.

Exit status: 0 printed (render) or collected (gc), 2 bad input (unknown pipeline,
environment not set, no data version, no namespace).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Optional

EXIT_BAD_INPUT = 2
GANG_KINDS = ("job", "jobset")  # resources.k8s.manifests.GANG_KINDS, kept here so `--help` imports nothing


def register(subparsers: Any) -> None:
    """Adds `k8s` and its subcommands to the `trainyard` parser."""
    parser = subparsers.add_parser("k8s", help="the Kubernetes objects of a trial")
    sub = parser.add_subparsers(dest="k8s_command", required=True)
    render = sub.add_parser("render", help="print, as YAML, exactly the objects a trial would submit")
    render.add_argument("pipeline", help="<team>/<pipeline>, e.g. vision/digits")
    render.add_argument("--trial", type=int, default=0, help="trial number (default 0)")
    render.add_argument(
        "--attempt", type=int, default=0, help="launch attempt: 100 x run retry + step retry (default 0)"
    )
    render.add_argument(
        "--kind",
        choices=GANG_KINDS,
        default=None,
        help="gang object: jobset or job (default: what the launcher submits, TRAINYARD_K8S_GANG_KIND, default jobset)",
    )
    render.add_argument(
        "--data-version", help="md5 of the accepted data version (default: the newest in the object store)"
    )
    render.set_defaults(func=cmd_render)
    gc = sub.add_parser("gc", help="delete gangs whose Dagster run has ended")
    gc.add_argument(
        "--namespace", action="append", default=[], help="team namespace (repeatable; default TRAINYARD_K8S_NAMESPACE)"
    )
    gc.add_argument("--dry-run", action="store_true", help="print what would be deleted, delete nothing")
    gc.add_argument("--api-url", help="explicit API server URL (kubectl proxy); default in-cluster or kubeconfig")
    gc.set_defaults(func=cmd_gc)


def _fail(message: str) -> int:
    print(f"trainyard k8s render: {message}", file=sys.stderr)
    return EXIT_BAD_INPUT


def cluster_environment(team_name: str, base: Optional[dict[str, str]] = None) -> dict[str, Any]:
    """The resources of the `cluster` environment as team `team_name`'s code location builds them.

    Raises:
        pipelines.environments.EnvironmentError_, ValueError: a variable is missing or invalid (the message names it).
    """
    from pipelines.catalog import workspace_teams  # lazy: loads the code locations
    from pipelines.environments import resources_for  # lazy: loads every resource

    env = dict(os.environ if base is None else base)
    team = next((t for t in workspace_teams() if t.name == team_name), None)
    return resources_for("cluster", team.environment(env) if team is not None else env)


def data_version(store: Any, pipeline: Any) -> Optional[str]:
    """The md5 of the pipeline's newest accepted data version in `store`; None before the first one."""
    from trainyard import naming

    uri = naming.validated_latest(store, pipeline.team, pipeline.name)
    return str(store.read_json(uri)["md5"]) if store.exists(uri) else None


def trial_spec(pipeline: Any, store: Any, number: int, md5: str) -> Any:
    """The `TrainSpec` of trial `number` of `pipeline` on data version `md5`, as far as its Kubernetes objects read it.

    Directory, pipeline, trial and distribution are the trial's (`assets.sweeps.trials`
    computes them the same way). The model's arguments are the pipeline's
    `hparams` (a trial's sampled ones are known at launch), and the data files
    those of the version's split; the objects carry neither. A distribution
    strategy 'auto' is resolved by the capacity planner per trial; the objects
    do not carry the strategy either, so it is shown as 'ddp'.
    """
    from training.spec import DataSpec, Distribution, ImportTarget, TrainSpec
    from trainyard import naming

    trial = naming.trial_key(number)
    study = naming.study_name(pipeline, md5)
    split = naming.validated_dir(store, pipeline.team, pipeline.name, f"{md5}-{pipeline.fingerprint()}")
    dist = pipeline.distribution
    if dist.strategy == "auto":
        dist = Distribution(**{**dist.model_dump(), "strategy": "ddp"})
    return TrainSpec(
        pipeline=pipeline.key,
        trial_id=trial,
        task=pipeline.model.task,
        prediction_task=pipeline.task,
        model=ImportTarget(path=pipeline.model.path, kwargs=dict(pipeline.model.hparams)),
        datamodule=ImportTarget(path=pipeline.model.datamodule),
        data=DataSpec(
            train_uri=f"{split}/train.parquet",
            val_uri=f"{split}/val.parquet",
            test_uri=f"{split}/test.parquet",
            features=pipeline.features,
            target=pipeline.target,
            version=md5,
        ),
        output_uri=naming.run_dir(store, pipeline.team, pipeline.name, study, trial),
        max_epochs=pipeline.model.max_epochs,
        batch_size=pipeline.model.batch_size,
        distribution=dist,
        checkpoint=pipeline.checkpoint,
    )


def render(key: str, trial: int = 0, attempt: int = 0, kind: Optional[str] = None, md5: Optional[str] = None,
           env: Optional[dict[str, str]] = None) -> list[dict[str, Any]]:
    """The objects attempt `attempt` of trial `trial` of pipeline `key` submits, in creation order.

    `kind` None: the launcher's own gang kind (`KubernetesLauncher.gang_kind`).

    Raises:
        KeyError: no pipeline `key`.
        ValueError: the cluster environment is not set up, or no data version is known.
    """
    from pipelines.catalog import find_pipeline  # lazy: loads the code locations

    pipeline = find_pipeline(key)
    resources = cluster_environment(pipeline.team, env)
    store, launcher = resources["store"], resources["launcher"]
    if md5 is None:
        try:
            md5 = data_version(store, pipeline)
        except Exception as e:  # storage unreachable, no credentials, a refused bucket: one line, not a traceback
            first = (str(e).strip().splitlines() or [""])[0]
            raise ValueError(
                f"cannot read {key}'s data versions from {store.uri()} ({type(e).__name__}: {first}); "
                "check the storage settings (AWS_ENDPOINT_URL, credentials) or pass --data-version <md5>"
            ) from e
    if md5 is None:
        raise ValueError(f"{key} has no accepted data version in {store.uri()} yet; pass --data-version <md5>")
    return launcher.trial_objects(trial_spec(pipeline, store, trial, md5), attempt, kind)


def cmd_render(args: argparse.Namespace) -> int:
    import yaml  # lazy: keeps `trainyard --help` fast

    if args.trial < 0 or args.attempt < 0:
        return _fail(f"--trial {args.trial} --attempt {args.attempt}: both are numbers from 0")
    try:
        objects = render(args.pipeline, args.trial, args.attempt, args.kind, args.data_version)
    except KeyError as e:
        return _fail(str(e.args[0]))
    except ValueError as e:  # the environment's own errors subclass it (missing or invalid settings)
        return _fail(str(e))
    sys.stdout.write(yaml.safe_dump_all(objects, sort_keys=False, explicit_start=True))
    names = ", ".join(f"{o['kind']} {o['metadata']['name']}" for o in objects)
    print(
        f"# {args.pipeline} {objects[0]['metadata']['labels'].get('trainyard.io/trial')} attempt {args.attempt}: "
        f"{names}",
        file=sys.stderr,
    )
    return 0


def _api_client(api_url: Optional[str]) -> Any:
    from kubernetes import client as k8s_client  # lazy: keeps `trainyard --help` fast
    from kubernetes import config as k8s_config

    if api_url:
        return k8s_client.ApiClient(k8s_client.Configuration(host=api_url))
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        configuration = k8s_client.Configuration()
        k8s_config.load_incluster_config(client_configuration=configuration)
        return k8s_client.ApiClient(configuration)
    return k8s_config.new_client_from_config()


def run_status_from(instance: Any) -> Any:
    """`run_id -> status name` (e.g. "STARTED"), None when `instance` does not know the run."""
    def status(run_id: str) -> Optional[str]:
        run = instance.get_run_by_id(run_id)
        return None if run is None else str(run.status.value)
    return status


def cmd_gc(args: argparse.Namespace) -> int:
    from dagster import DagsterInstance  # lazy
    from kubernetes import client as k8s_client

    from common.settings import settings
    from resources.k8s.gangs import collect_garbage

    namespaces = args.namespace or [n for n in [settings().k8s_namespace] if n]
    if not namespaces:
        print("trainyard k8s gc: no namespace: pass --namespace or set TRAINYARD_K8S_NAMESPACE", file=sys.stderr)
        return EXIT_BAD_INPUT
    status = run_status_from(DagsterInstance.get())
    api = _api_client(args.api_url)
    try:
        batch, core, custom = k8s_client.BatchV1Api(api), k8s_client.CoreV1Api(api), k8s_client.CustomObjectsApi(api)
        collected = [
            g
            for ns in namespaces
            for g in collect_garbage(batch, core, ns, status, dry_run=args.dry_run, custom=custom)
        ]
    finally:
        api.close()
    print(
        f"# {'would delete' if args.dry_run else 'deleted'} {len(collected)} gang(s) in {', '.join(namespaces)}",
        file=sys.stderr,
    )
    return 0
