"""``flower-superlink``, ``flower-supernode`` and ``flower-superexec`` of Flower 1.42,
with four repairs.

    python -m fedefc_cli.flower_repairs superlink [flower-superlink's flags]
    python -m fedefc_cli.flower_repairs supernode [flower-supernode's flags]
    python -m fedefc_cli.flower_repairs superexec [flower-superexec's flags]

``fedefc deploy supernode|superlink``, their service units and
:class:`.deploy_local.LocalDeployment` start every SuperLink, SuperNode and SuperExec
this way (:func:`command`): Flower's own process, in this process, with these repairs
(docs/RELIABILITY.md, "A SuperLink restart mid-round" and "The SuperLink's database
under load"):

1. **A message of a run that stopped is dropped with its task.** A SuperNode receives a
   message in steps (the message, its objects, the confirmation), after it has stored
   the message and created the task that a ClientApp will run. When the run stops
   meanwhile (a restarted SuperLink, a ServerApp that ended its run), the SuperLink
   refuses the next step, and Flower raises ``RunNotRunningException``, a
   ``BaseException`` that the SuperNode's own cleanup (``except Exception``) misses: it
   logs ``Ignoring message`` and leaves the message and its task behind. Its SuperExec
   then starts a ClientApp for it that waits hours for objects that never come, or, with
   every object there, trains and leaves a reply that nothing is waiting for. Here the
   refusal is an ordinary exception (:class:`RunStopped`), so Flower's cleanup runs: the
   message, its objects and its task are dropped, and a ClientApp already started for
   it is refused by the Runtime API and exits.
2. **A node answers the message it received.** After receiving a message, the SuperNode
   waits for *a* reply and sends every reply there is. One reply left over from before
   (the case above) is sent in place of the current one, whose reply then waits for the
   next message: from then on the node answers each message with the previous one
   (issue 49's trial: after a SuperLink restart, node 0 answered every message of the
   resumed run one message late, and the run failed). Here the node sends replies until
   the current message's own is sent: a left-over reply goes out (the SuperLink ignores
   one of a run that stopped) and never takes the current one's place.
3. **A SuperExec reaps its app processes.** It starts each ServerApp or ClientApp with
   ``subprocess.Popen`` and drops it, so one that exited stays a defunct process until
   the next start. Here every start is kept and polled once a second (the SuperExec's
   own loop), so an exited app is reaped within a second. Flower's own app commands are
   not started this way at all but forked from the SuperExec's zygote, which reaps them
   (:mod:`.app_zygote`: torch and Flower imported once, not once per message).
4. **A SuperLink's writer waits a minute for another, not 5 s.** Flower opens every
   sqlite connection of the SuperLink's state with ``busy_timeout = 5000``; on a machine
   so loaded that the writer holding the lock is not scheduled for 5 s, the next writer
   fails with ``database is locked`` and a node's message or a run's step is lost. Here
   the pragma is :data:`BUSY_TIMEOUT_MS`, the rest of Flower's pragmas kept.

Their console lines carry the time they were written (:mod:`common.flower_log`).

Each repair patches one name of Flower's (``start_client_internal._pull_and_store_message``
and ``._push_messages``; ``subprocess_executor.subprocess`` and
``SubprocessExecutor.reconcile``; ``sql_mixin.SQLITE_PRAGMAS``): pinned to flwr 1.42.0
and checked by tests/test_flower_repairs.py against Flower's own functions, so that an
upgrade that moves them fails loudly.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import types
from collections.abc import Callable
from typing import Any

from .app_zygote import ZYGOTE_SWITCH, Zygote, task_of

ROLES = {  # role -> (Flower's executable, the entry point it runs)
    "superlink": ("flower-superlink", "flwr.superlink.cli:flower_superlink"),
    "supernode": ("flower-supernode", "flwr.supernode.cli:flower_supernode"),
    "superexec": ("flower-superexec", "flwr.supercore.cli:flower_superexec"),
}
BUSY_TIMEOUT_MS = 60_000  # how long a SuperLink's writer waits for another (Flower's: 5 s)


def command(role: str, flags: list[str]) -> list[str]:
    """The command line of Flower's ``role`` process with :func:`repair` applied."""
    return [sys.executable, "-m", "fedefc_cli.flower_repairs", role, *flags]


class RunStopped(RuntimeError):
    """The SuperLink refused a step of receiving a message: its run is not running."""


def stopped_as_error(step: Callable[..., Any], what: str) -> Callable[..., Any]:
    """``step`` raising :class:`RunStopped` where it raised Flower's
    ``RunNotRunningException`` (a BaseException)."""
    from flwr.supercore.run import RunNotRunningException  # lazy: flwr, 0.5 s of CPU

    def checked(run_id: int, *args: Any) -> Any:
        try:
            return step(run_id, *args)
        except RunNotRunningException:
            raise RunStopped(f"run {run_id} is no longer running ({what} refused): the "
                             "message is dropped") from None
    return checked


def answered(state: Any, message_id: str) -> bool:
    """Whether the message ``message_id`` is gone from the node's store: its reply was
    sent (Flower deletes a message with its reply), or it was dropped."""
    with state.lock_msg_store:
        return message_id not in state.msg_store


def repair_supernode(module: Any) -> None:
    """Repairs 1 and 2 (module docstring) on ``flwr.supernode.start_client_internal``."""
    pull, push = module._pull_and_store_message, module._push_messages
    current: list[str] = []  # the message received last, until it is answered

    def pull_and_store_message(*, state: Any, receive: Callable[[], Any],
                               pull_object: Callable[..., Any],
                               confirm_message_received: Callable[..., Any],
                               **kwargs: Any) -> int | None:
        received: list[str] = []

        def receive_noted():
            got = receive()
            if got is not None:
                received.append(got[0].metadata.message_id)
            return got

        run_id = pull(state=state, receive=receive_noted,
                      pull_object=stopped_as_error(pull_object, "its objects"),
                      confirm_message_received=stopped_as_error(confirm_message_received,
                                                                "its confirmation"),
                      **kwargs)
        current[:] = received[-1:] if run_id is not None else []
        return run_id

    def push_messages(*, state: Any, **kwargs: Any) -> None:
        push(state=state, **kwargs)
        while current and not answered(state, current[0]):
            push(state=state, **kwargs)  # a left-over reply went out: wait for the current
        current.clear()

    module._pull_and_store_message = pull_and_store_message
    module._push_messages = push_messages


def repair_superexec(module: Any) -> None:
    """Repair 3 (module docstring) on ``flwr.supercore.superexec.executor.
    subprocess_executor``: the executor's processes are kept and reaped; Flower's own app
    commands are forked from the SuperExec's zygote (:mod:`.app_zygote`)."""
    started: list[subprocess.Popen] = []

    class Kept(subprocess.Popen):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            started.append(self)

    reconcile = module.SubprocessExecutor.reconcile
    zygote = Zygote() if os.environ.get(ZYGOTE_SWITCH, "on") != "off" else None

    def launch(args: list[str], **kwargs: Any) -> None:
        task = task_of(args) if zygote else None
        if task is None:
            Kept(args, **kwargs)
        else:
            zygote.start(*task, quiet=kwargs.get("stdout") == subprocess.DEVNULL)

    def reaping(self) -> None:
        started[:] = [proc for proc in started if proc.poll() is None]
        reconcile(self)

    module.subprocess = types.SimpleNamespace(Popen=launch, DEVNULL=subprocess.DEVNULL,
                                              PIPE=subprocess.PIPE)
    module.SubprocessExecutor.reconcile = reaping


def repair_superlink(module: Any) -> None:
    """Repair 4 on ``module`` (``flwr.supercore.sql_mixin``): every sqlite connection of
    the SuperLink's state waits :data:`BUSY_TIMEOUT_MS` for another writer."""
    pragmas = dict(module.SQLITE_PRAGMAS)
    if "busy_timeout" not in pragmas:
        raise RuntimeError("flwr's SQLITE_PRAGMAS has no busy_timeout: the repair is pinned "
                           "to flwr 1.42.0")
    module.SQLITE_PRAGMAS = tuple({**pragmas, "busy_timeout": str(BUSY_TIMEOUT_MS)}.items())


def repair(role: str) -> None:
    """Apply the repairs of ``role``'s process to Flower's modules in this process."""
    if role == "superlink":
        repair_superlink(importlib.import_module("flwr.supercore.sql_mixin"))
    elif role == "supernode":
        repair_supernode(importlib.import_module("flwr.supernode.start_client_internal"))
    else:
        repair_superexec(importlib.import_module(
            "flwr.supercore.superexec.executor.subprocess_executor"))


def main(argv: list[str]) -> None:
    if not argv or argv[0] not in ROLES:
        sys.exit("usage: python -m fedefc_cli.flower_repairs superlink|supernode|superexec "
                 "[Flower's flags]")
    role, rest = argv[0], argv[1:]
    name, entry = ROLES[role]
    from common.flower_log import timestamp_flower_lines  # lazy: flwr, 0.8 s for `fedefc`

    repair(role)
    timestamp_flower_lines()
    sys.argv = [os.path.join(os.path.dirname(sys.executable), name), *rest]
    package, func = entry.split(":")
    sys.exit(getattr(importlib.import_module(package), func)())


if __name__ == "__main__":
    main(sys.argv[1:])
