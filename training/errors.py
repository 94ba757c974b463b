"""Errors a training process classifies its failures by (see `training.entrypoint.main`)."""


class ConfigError(ValueError):
    """The spec cannot work (bad import path, rejected hyperparameters, a misfit strategy); retrying cannot help."""


class Preempted(Exception):
    """SIGTERM reached a rank; a checkpoint was committed and the run stops to be resumed."""


class StrategyConfigError(ConfigError):
    """The distribution cannot run in this process group or with this model; retrying cannot help.

    A `ConfigError`, so the entrypoint exits with `EXIT_BAD_CONFIG` wherever it is raised.
    """
