"""Which Ray cluster a simulation's clients run on (``--ray-address``; docs/BENCHMARKS.md,
"Past one box: a Ray cluster").

Flower's Ray backend calls ``ray.init()`` with no address in the simulation process the
SuperLink starts. Ray then joins the cluster named by ``RAY_ADDRESS`` if it is set, else
the cluster a ``ray start`` last started on this machine, else starts a private one. The
second rule would make every simulation on a machine where someone ran ``ray start`` join
that cluster unasked, so the launcher always says which: ``RAY_ADDRESS=local`` (a private
Ray, the default) or the ``host:port`` of a running cluster, whose nodes then serve the
clients.
"""

from __future__ import annotations

import argparse
import socket

from .errors import UsageError

LOCAL = "local"  # Ray's own word for "start a private instance, whatever runs here"


def ray_address(text: str) -> str:
    """``HOST:PORT`` of a running Ray cluster's head (argparse type), or an error naming the
    value and the fix."""
    host, sep, port = text.strip().rpartition(":")
    if not (sep and host and port.isdigit() and 0 < int(port) < 65536) \
            or text.startswith("ray://"):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not HOST:PORT of a Ray head; give the address `ray start --head "
            "--port=PORT` printed, e.g. 10.0.0.5:6379 (the GCS port, not the dashboard's "
            "and not a ray:// client address)")
    return f"{host}:{int(port)}"


def check_reachable(address: str, timeout: float = 5.0) -> None:
    """Raise ``UsageError`` unless something answers at ``address`` (a refused or silent
    port fails here, before the data is loaded, rather than in the simulation process)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return
    except OSError as err:
        raise UsageError(
            f"--ray-address {address}: no Ray cluster answers there ({err}); start its head "
            f"first (`ray start --head --port={port}` on {host}) or leave --ray-address out "
            "to run on this machine alone") from None


def ray_env(address: str | None) -> dict[str, str]:
    """The environment that makes the simulation's ``ray.init()`` join ``address`` (None: a
    private Ray on this machine, never a cluster found here by chance)."""
    return {"RAY_ADDRESS": address or LOCAL}
