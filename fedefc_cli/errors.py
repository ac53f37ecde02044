"""The ways a ``fedefc`` command fails, and their exit codes.

Bad input (a run-config key, a preset, a flag, the data, a checkpoint) exits 2 before
anything starts, naming the value and the fix; a Flower process or run that fails
after starting exits 1 (:data:`EXIT_CODES`); a run that completed ``degraded`` (a
partition missed more rounds than ``max-missed-share`` allows: docs/RELIABILITY.md)
exits :data:`EXIT_DEGRADED`, its reason on stderr.
"""

from __future__ import annotations

from common.config import ConfigError
from common.data_files import DatasetError
from common.models import ModelError
from common.noise import NoiseError
from common.partition import PartitionError
from common.results import OutputDirError
from fedefc_client.private_data import PrivateDataError
from fedefc_server.checkpoint import CheckpointError

EXIT_DEGRADED = 3  # the run completed, but without a site for more rounds than allowed


class UsageError(ValueError):
    """A command-line flag or argument is unusable; the message names it and the fix."""


class LaunchError(RuntimeError):
    """A Flower process could not be started, or a run did not complete."""


BAD_INPUT = (UsageError, ConfigError, OutputDirError, DatasetError, NoiseError, PartitionError,
             CheckpointError, PrivateDataError, ModelError)
EXIT_CODES: tuple[tuple[tuple[type[Exception], ...], int], ...] = ((BAD_INPUT, 2),
                                                                   ((LaunchError,), 1))
