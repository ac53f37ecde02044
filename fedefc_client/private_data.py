"""A SuperNode's own private training data, read from the path in its node config.

The formats (docs/OWN-DATA.md, "Formats"; docs/DEPLOYMENT.md, "Node data", mode (b)):
an ``.npz`` with ``images`` (uint8) or ``features`` (floats) and ``labels``, or an
ImageFolder directory whose class folders are named by class index
(:mod:`common.data_files`). The data must agree with the run: the input shape and the
number of classes K of :func:`common.datasets.task_shape` (the paper's datasets' own,
or ``input-shape`` / ``num-classes``), so that every node trains the same model. Every
problem raises :class:`PrivateDataError` naming the node, the path, what was found and
what the run expects.
"""

from __future__ import annotations

from common.data_files import DatasetError, PrivateDataError, Samples, describe_shape, read_samples
from common.models import TaskShape


def expected_text(task: TaskShape) -> str:
    """What the run expects of every node's data, in words."""
    return (f"the run expects {describe_shape(task.input_shape)} and labels "
            f"0..{task.num_classes - 1} (K={task.num_classes})")


def load_private_data(path: str, task: TaskShape, node: str) -> Samples:
    """The node's samples from ``path``, checked against the run's input shape and K."""
    where = f"{node}: data-path={path!r}"
    try:
        samples = read_samples(path, where, task.input_shape)
    except DatasetError as err:
        raise PrivateDataError(f"{err}; {expected_text(task)}") from None
    top = int(samples.y.max())
    if top >= task.num_classes:
        raise PrivateDataError(f"{where}: label {top} is outside 0..{task.num_classes - 1}; "
                               f"{expected_text(task)}: fix the labels, or raise the run's "
                               "num-classes")
    return samples
