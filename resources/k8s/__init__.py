"""Kubernetes: a trial as a gang of pods under Kueue.

- `names`: label keys, object names and the deterministic Job name.
- `config`: the validated inputs (`K8sJobConfig`, `Toleration`, `TeamQuota`).
- `manifests`: pure builders of a trial's JobSet, or Indexed Job and Service.
- `cluster`: pure builders of the cluster-wide objects (namespaces with Pod Security labels,
  PriorityClasses, Kueue, per-team RBAC).
- `helm`: pure builders of the Dagster chart's values (one isolated code location per team).
- `pods`: read-side views of the API's pods and logs.
- `kinds`: the two gang kinds (JobSet, the default; Indexed Job) read into one view, and their API calls.
- `gangs`: one gang per trial attempt (re-attach or delete), `trainyard k8s gc`.
- `stuck`: admitted gangs that cannot start, and the bounds before the trial fails.
- `supervisor`: `JobSupervisor`, the waiter that submits, watches and cleans up.
- `watch`: what one watch keeps, and its outcomes (success, a vanished gang, a mapped failure).
- `launcher`: `KubernetesLauncher`, the Dagster resource around the supervisor.
- `errors`: the errors this package adds to the launcher hierarchy.
"""
