"""The sweep's assets: `sweep` (the study and its trial partitions), `trial_model` and `best_model`, and a trial run's
hand-on.

The sweep's other parts live in their layers: the search space and the pure rules in `trainyard.search` and
`trainyard.trials`, the study store and trial runs in `resources.sweeps`, the sweep sensor in `pipelines.sensors`,
and the pruning callback that runs inside a trial in `training.pruning` (docs/architecture-notes.md says why).
"""
