"""Errors a training process classifies its failures by (see `training.entrypoint.main`)."""


class ConfigError(ValueError):
    """The spec cannot work (bad import path, rejected hyperparameters, a misfit strategy); retrying cannot help."""


class Preempted(Exception):
    """SIGTERM reached a rank; a checkpoint was committed and the run stops to be resumed."""
