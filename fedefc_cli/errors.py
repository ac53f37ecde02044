"""The ways a ``fedefc`` command fails, and their exit codes.

Bad input (a run-config key, a preset, a flag, the data, a checkpoint) exits 2 before
anything starts, naming the value and the fix; a Flower process or run that fails
after starting exits 1 (:func:`exit_code`); a run that completed ``degraded`` (a
partition missed more rounds than ``max-missed-share`` allows: docs/RELIABILITY.md)
exits :data:`EXIT_DEGRADED`, its reason on stderr.
"""

from __future__ import annotations

from common.errors import ConfigError

EXIT_DEGRADED = 3  # the run completed, but without a site for more rounds than allowed


class UsageError(ValueError):
    """A command-line flag or argument is unusable; the message names it and the fix."""


class LaunchError(RuntimeError):
    """A Flower process could not be started, or a run did not complete."""


def exit_code(err: Exception) -> int | None:
    """2 for bad input (a flag, a run-config key, the data, a checkpoint), 1 for a Flower
    process or run that failed, None for anything else (a bug: its traceback shows)."""
    if isinstance(err, (UsageError, ConfigError)):
        return 2
    if isinstance(err, LaunchError):
        return 1
    # the other kinds of bad input live beside torch; a failing command may import it
    from common.data_files import DatasetError  # lazy: with torch, 1.9 s of CPU
    from common.models import ModelError  # lazy: torch, 1.9 s of CPU
    from common.noise import NoiseError  # lazy: with torch, 1.9 s of CPU
    from common.partition import PartitionError  # lazy: with torch, 1.9 s of CPU
    from common.results import OutputDirError  # lazy: with torch, 1.9 s of CPU
    from fedefc_client.private_data import PrivateDataError  # lazy: torch, 1.9 s of CPU
    from fedefc_server.checkpoint import CheckpointError  # lazy: torch, 1.9 s of CPU
    bad_input = (OutputDirError, DatasetError, NoiseError, PartitionError, CheckpointError,
                 PrivateDataError, ModelError)
    return 2 if isinstance(err, bad_input) else None
