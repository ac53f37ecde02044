"""The coordinator's side of a deployment, through the flwr CLI: ``fedefc deploy
connection`` (a ``[superlink.NAME]`` entry in ``$FLWR_HOME/config.toml``), ``register``
(SuperNode public keys, for node authentication) and ``submit``: ``flwr run`` the app on
a connection (signed with ``--sign-key``: :mod:`.app_signing`), refused while another
run runs there; follow its log, resume a run whose ServerApp was stopped from outside,
and exit non-zero, with the reason, unless it completed (:class:`.flower.RunOutcome`).
"""

from __future__ import annotations

import argparse
import functools
import ipaddress
import os
import re
import shlex
import socket
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

import tomli_w

from common.errors import ConfigError

from .deploy_flags import check_private
from .end_of_run import tell_run
from .errors import EXIT_DEGRADED, LaunchError, UsageError
from .flower import RunOutcome, SuperLinkGone, active_runs, flwr_env, flwr_json, submit_run
from .run_configs import inexact_resume_note, merged_config, resume_config


def write_connection(flwr_home: Path, name: str, address: str,
                     ca_cert: str | None = None) -> Path:
    """Add or replace ``[superlink.NAME]`` in ``flwr_home/config.toml`` (others kept)."""
    if ca_cert and not Path(ca_cert).is_absolute():
        raise UsageError(f"root certificate {ca_cert!r} must be an absolute path")
    path = flwr_home / "config.toml"
    config: dict[str, Any] = {}
    if path.exists():
        with open(path, "rb") as fh:
            config = tomllib.load(fh)
    links = config.setdefault("superlink", {})
    links[name] = ({"address": address, "root-certificates": ca_cert} if ca_cert
                   else {"address": address, "insecure": True})
    links.setdefault("default", name)
    flwr_home.mkdir(parents=True, exist_ok=True)
    path.write_bytes(tomli_w.dumps(config).encode())
    return path


def cmd_connection(args: argparse.Namespace) -> int:
    home = Path(args.flwr_home).resolve() if args.flwr_home else default_flwr_home()
    ca = str(Path(args.ca_cert).resolve()) if args.ca_cert else None
    path = write_connection(home, args.name, args.address, ca)
    print(f"connection {args.name!r} -> {args.address} ({'TLS' if ca else 'insecure'}) "
          f"written to {path}")
    return 0


def default_flwr_home() -> Path:
    """Where the flwr CLI keeps its connections: $FLWR_HOME, else ~/.flwr."""
    return Path(os.environ.get("FLWR_HOME") or Path.home() / ".flwr")


REFUSED_S = 30.0  # how long a first ask waits for a SuperLink whose port refuses (one
# started just before, as in the quick start, can take that long to listen on a busy machine)
STARTING_S = 600.0  # how long it waits while a SuperLink on this machine is starting there


def connection_address(connection: str, env: dict[str, str]) -> tuple[str, int] | None:
    """(host, port) of ``connection`` in ``$FLWR_HOME/config.toml``, if it is there."""
    path = Path(env.get("FLWR_HOME") or default_flwr_home()) / "config.toml"
    try:
        with open(path, "rb") as fh:
            address = str(tomllib.load(fh)["superlink"][connection]["address"])
        host, _, port = address.rpartition(":")
        return host.strip("[]"), int(port)
    except (OSError, KeyError, TypeError, ValueError, tomllib.TOMLDecodeError):
        return None


def port_refuses(address: tuple[str, int] | None) -> bool:
    """Whether nothing listens at ``address`` (the connection is refused at once)."""
    if address is None:
        return False
    try:
        with socket.create_connection(address, timeout=5.0):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:  # a timeout, a name that does not resolve: flwr says what it is
        return False


@functools.lru_cache(maxsize=None)
def is_this_machine(host: str) -> bool:
    """Whether ``host`` names this machine through a loopback address (looked up once per
    host: :func:`wait_for_superlink` asks every second)."""
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def starting_superlink(address: tuple[str, int] | None) -> int | None:
    """The pid of a process on this machine that serves or starts a SuperLink on the port
    of ``address`` (``fedefc deploy superlink`` or its ``flower-superlink``: a command line
    that names a superlink and ``--port PORT``, no supernode), read from ``/proc``; None
    where there is none, ``address`` is another machine's, or ``/proc`` is absent (then
    only :data:`REFUSED_S` applies)."""
    if address is None or not is_this_machine(address[0]):
        return None
    port = str(address[1])
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            words = cmdline.read_bytes().decode(errors="replace").split("\0")
        except OSError:  # the process ended while we looked
            continue
        text = " ".join(words)
        if "superlink" in text and "supernode" not in text and any(
                flag == "--port" and value == port for flag, value in zip(words, words[1:])):
            return int(cmdline.parent.name)
    return None


def flwr_words(message: str) -> str:
    """flwr's error text without its progress lines, as one sentence without a closing
    full stop (it ends its own with two)."""
    return message.strip().split("\n\n")[-1].strip().rstrip(".")


def wait_for_superlink(connection: str, env: dict[str, str], cwd: Path,
                       timeout: float = 60.0, refused_s: float = REFUSED_S
                       ) -> dict[str, Any]:
    """Wait until the SuperLink of ``connection`` answers ``flwr ls`` (one started just
    before, as in the quick start, may need a few seconds); LaunchError after ``timeout``,
    or after ``refused_s`` while nothing listens at its address (the port refuses: no
    SuperLink there, or the connection's address is wrong), said at the first refusal.
    While a SuperLink on this machine is starting on that port (:func:`starting_superlink`:
    a busy machine can take minutes), the wait goes on as long as that process lives, up
    to :data:`STARTING_S`, and ``refused_s`` counts from its end. Returns what ``flwr ls``
    said (its runs)."""
    start = time.monotonic()
    address = connection_address(connection, env)
    where = f"{address[0]}:{address[1]}" if address else connection
    said: set[int | None] = set()
    refused_since = start
    while True:
        if port_refuses(address):
            pid = starting_superlink(address)
            if pid not in said:
                print(f"fedefc deploy: nothing listens on {where} (connection {connection!r} "
                      "refused); " + (f"waiting up to {refused_s:.0f} s for a SuperLink to "
                                      "start there" if pid is None else
                                      f"the SuperLink on this machine (pid {pid}) is "
                                      "starting there: waiting for it"),
                      file=sys.stderr, flush=True)
                said.add(pid)
            now = time.monotonic()
            if pid is not None and now - start < STARTING_S:
                refused_since = now
            if now - refused_since > refused_s:
                raise LaunchError(
                    f"nothing listens on {where}, the address of connection {connection!r}: "
                    f"the connection was refused for {refused_s:.0f} s. Is the SuperLink "
                    "running (deploy/start-superlink.sh; its log says which --host and "
                    "--port it serves), and is the connection's address right (fedefc "
                    f"deploy connection {connection} HOST:PORT)?")
            time.sleep(1.0)
            continue
        res = flwr_json(["ls", connection], env, cwd)
        if res.get("success", True):
            return res
        message = flwr_words(str(res.get("error-message", res)))
        if "unavailable" not in message:
            raise UsageError(f"flwr cannot use connection {connection!r}: {message} (add it "
                             f"with: fedefc deploy connection {connection} HOST:PORT)")
        if time.monotonic() - start > timeout:
            raise LaunchError(f"the SuperLink of connection {connection!r} did not answer "
                              f"within {timeout:.0f} s: {message}. "
                              "Is it running (deploy/start-superlink.sh), and is the "
                              "connection's address right (fedefc deploy connection)?")
        time.sleep(2.0)


def public_key_file(path: str | Path) -> str:
    """``path`` made absolute, after checking that it is a file holding no private key."""
    file = Path(path).expanduser().resolve()
    if not file.is_file():
        raise UsageError(f"public key {file} not found (nothing registered)")
    if "PRIVATE KEY" in file.read_text(errors="replace"):
        raise UsageError(f"{file} is a private key: register its public key ({file}.pub) "
                         "and keep the private key on its node (nothing registered)")
    return str(file)


def cmd_register(args: argparse.Namespace) -> int:
    """``flwr supernode register`` every public key, once the SuperLink answers; a key is
    named after its file (``node-0.pub`` -> ``node-0``)."""
    keys = [public_key_file(k) for k in args.public_keys]
    env, cwd = flwr_env(default_flwr_home()), Path.cwd()
    wait_for_superlink(args.connection, env, cwd)
    failed = []
    for key in keys:
        name = Path(key).name.removesuffix(".pub")
        res = flwr_json(["supernode", "register", key, args.connection, "--name", name],
                        env, cwd)
        if res.get("success", True):
            print(f"registered {key} as SuperNode {name!r} (node id {res.get('node-id')})")
        else:
            failed.append(f"{key}: {str(res.get('error-message', res)).strip()}")
    if failed:
        raise LaunchError("registering failed for " + "; ".join(failed))
    return 0


def refuse_a_busy_superlink(connection: str, env: dict[str, str], cwd: Path,
                            listing: dict[str, Any] | None = None) -> None:
    """UsageError naming the runs that have not finished on the SuperLink (``listing``:
    what ``flwr ls`` said just now, else asked again): a second run would share the
    SuperNodes with them (each slowing the other, both recorded as if alone) and its
    out-dir may be theirs."""
    busy = active_runs(connection, env, cwd, listing)
    if busy:
        listed = ", ".join(f"{run_id} ({status})" for run_id, status in busy)
        first = busy[0][0]
        raise UsageError(
            f"the SuperLink of connection {connection!r} is running another run: {listed}; "
            f"nothing submitted. Wait for it to end (flwr log {first} {connection} --stream) "
            f"or stop it (flwr stop {first} {connection}), then submit again")


def superlink_lost_text(connection: str, when: str, resume: str) -> str:
    """Where to look when the SuperLink stopped during a run, and how to go on (the
    command ``resume``: :func:`resume_command`)."""
    return (f"The SuperLink of connection {connection!r} stopped answering at {when}. Its "
            "log is superlink.log in its state folder on the SuperLink machine (the "
            "folder fedefc deploy superlink printed; ~/.fedefc/superlink/ by default), or "
            "journalctl -u fedefc-superlink for the service; its SuperExec's is "
            "superexec.log beside it. A SuperLink that restarts ends the run it was "
            f"running as failed; once it answers again, continue the run with: {resume}")


def resume_command(args: argparse.Namespace, out_dir: str) -> str:
    """The ``fedefc deploy submit`` command that resumes the run of ``args`` (a submit's
    flags) whose out-dir is ``out_dir``, complete for the deployment it came from: its
    connection (with ``FLWR_HOME`` where one is set), its signing key and key id, and,
    where the out-dir is not on this machine (its config.json cannot be read here), the
    preset and ``--set`` of the submission, which the resumed run must repeat."""
    words = ["fedefc", "deploy", "submit", args.connection]
    if args.preset and not (Path(out_dir) / "config.json").is_file():
        words.append(args.preset)
    words += ["--resume", out_dir]
    if not (Path(out_dir) / "config.json").is_file():
        for override in args.overrides:
            words += ["--set", override]
    if args.sign_key:
        words += ["--sign-key", str(Path(args.sign_key).expanduser().resolve())]
    if args.key_id:
        words += ["--key-id", args.key_id]
    home = os.environ.get("FLWR_HOME")
    return (f"FLWR_HOME={shlex.quote(home)} " if home else "") + shlex.join(words)


SILENT_NODE = re.compile(r"node (\d+) failed to declare: no reply within")


def silent_nodes_hint(reason: str, connection: str = "CONNECTION") -> str | None:
    """What to do about the nodes that a failed run's ``reason`` names as never
    answering: each may be stuck (docs/RELIABILITY.md, "A SuperLink restart
    mid-round"), and restarting it clears whatever it holds."""
    nodes = sorted(set(SILENT_NODE.findall(reason)))
    if not nodes:
        return None
    return (f"Node{'s' * (len(nodes) > 1)} {', '.join(nodes)} never answered: if "
            f"{'they are' if len(nodes) > 1 else 'it is'} online (flwr supernode ls "
            f"{connection} lists the node ids, each by its key's name with node "
            "authentication), a SuperNode may be stuck: restart it on its machine (Ctrl-C "
            "its fedefc deploy supernode and start it again, or sudo systemctl restart "
            "fedefc-supernode-K), then submit the run again; its supernode.log says what it "
            "received last")


def explain_failure(outcome: RunOutcome, out_dir: str, connection: str,
                    resume: str | None = None) -> str:
    """What the operator reads when a run did not complete: its status, the reason its
    log gives, and what is (and is not) in its out-dir; ``resume``: the command that
    resumes it (:func:`resume_command`)."""
    reason = outcome.failure or "its log names no reason"
    ended = (f"failed (its ServerApp gave up; Flower still said {outcome.status})"
             if outcome.app_failed and not outcome.status.startswith("finished")
             else f"ended {outcome.status}")
    lines = [f"run {outcome.run_id} {ended}: it did not complete. Reason: {reason}",
             f"Its whole log: flwr log {outcome.run_id} {connection}"]
    resume = resume or f"fedefc deploy submit {connection} --resume {out_dir}"
    if outcome.superlink_lost:
        lines.append(superlink_lost_text(connection, outcome.superlink_lost, resume))
    elif outcome.interrupted:
        lines.append(f"Its checkpoint of round {outcome.last_round} is kept; continue the "
                     f"run with: {resume}")
    if hint := silent_nodes_hint(reason, connection):
        lines.append(hint)
    if "already holds results" in reason:
        lines.append(f"Its out-dir {out_dir} holds an earlier run's results, left untouched; "
                     "this run wrote nothing there. Submit again with a new out-dir.")
    else:
        lines.append(f"What it wrote before failing, if anything, is in {out_dir} on the "
                     "SuperLink machine (its summary.json, if written, says \"status\": "
                     "\"failed\" and why).")
    return "\n".join(lines)


def resume_submission(folder: str, preset: str | None, overrides: list[str]
                      ) -> dict[str, Any]:
    """The run config that resumes the deployment run whose out-dir is ``folder`` (on the
    SuperLink machine). Where that folder is on this machine too (the operator works on
    the SuperLink machine, or fetched it), its own ``config.json`` with ``overrides``
    (e.g. ``rounds``), as ``fedefc resume`` does; else the preset and overrides, which
    must repeat the run's config (the ServerApp refuses a checkpoint of another config,
    naming the keys). ConfigError naming the value and the fix otherwise."""
    from common.methods import load_run_config  # lazy: torch, 1.9 s of CPU
    from fedefc_server import checkpoint  # lazy: torch, 1.9 s of CPU
    from fedefc_server.checkpoint import CheckpointError  # lazy: torch, 1.9 s of CPU
    path = Path(folder).expanduser()
    if not path.is_absolute():
        raise ConfigError(f"--resume {folder!r} is not absolute; give the run's out-dir as "
                          "the absolute folder on the SuperLink machine, e.g. --resume "
                          "/srv/fedefc/runs/run1")
    if (path / "config.json").is_file():
        if preset:
            raise ConfigError(f"--resume {folder} takes the run's own config from its "
                              f"config.json; leave out the preset {preset!r} (change keys "
                              "that may differ with --set, e.g. --set rounds=60)")
        if not (path / checkpoint.FILE).is_file():
            raise CheckpointError(f"--resume {folder}: no {checkpoint.FILE} there; the run "
                                  "finished no round, so there is nothing to resume: submit "
                                  "it anew with a new out-dir")
        print(f"fedefc deploy: resuming the run in {path} with its own config.json",
              flush=True)
        return resume_config(str(path), overrides)
    merged = {**merged_config(preset, overrides), "resume-from": str(path),
              "out-dir": str(path)}
    print(f"fedefc deploy: {path} is not on this machine: resuming it with the config of "
          "the preset and --set given, which must be the run's (the ServerApp refuses a "
          "checkpoint of another config, naming the keys)", flush=True)
    return load_run_config(merged).to_flat()


def progress(text: str) -> None:
    """One step of ``submit``, on stderr as it starts (the run's log goes to stdout)."""
    print(f"fedefc deploy: {text} ...", file=sys.stderr, flush=True)


def submit_resuming(connection: str, run_config: dict[str, Any], env: dict[str, str],
                    sign: tuple[str, str] | None, max_resumes: int,
                    reconnect_s: float) -> RunOutcome:
    """Submit the run and follow it; while it is :attr:`.flower.RunOutcome.interrupted`
    (its ServerApp stopped from outside: its SuperExec or the SuperLink exited, and the
    supervisor of ``fedefc deploy superlink`` or systemd started it again) and got
    further than the attempt before, submit it again resuming from its out-dir's
    checkpoint (docs/DEPLOYMENT.md, "Resuming a run"), at most ``max_resumes`` times. A
    SuperLink that stops answering is waited for ``reconnect_s`` each time. How the last
    attempt ended."""
    out_dir = str(run_config["out-dir"])
    outcome = submit_run(connection, run_config, env, Path.cwd(), sign_key=sign, say=progress,
                         reconnect_s=reconnect_s)
    reached, resumes = 0, 0
    while outcome.interrupted and outcome.last_round > reached and resumes < max_resumes:
        reached, resumes = outcome.last_round, resumes + 1
        print(f"fedefc deploy: run {outcome.run_id} stopped unfinished after round "
              f"{outcome.last_round} ({outcome.failure or 'its log names no reason'}); "
              f"resuming it from its checkpoint in {out_dir} (resume {resumes} of at most "
              f"{max_resumes}: --max-resumes)", file=sys.stderr, flush=True)
        wait_for_superlink(connection, env, Path.cwd(), reconnect_s, refused_s=reconnect_s)
        outcome = submit_run(connection, {**run_config, "resume-from": out_dir,
                                          "out-dir": out_dir},
                             env, Path.cwd(), sign_key=sign, say=progress,
                             reconnect_s=reconnect_s)
    if outcome.interrupted and max_resumes:
        why = (f"all {max_resumes} allowed (--max-resumes) are used" if resumes == max_resumes
               else f"this attempt got no further than round {outcome.last_round}, as the "
               "one before")
        print(f"fedefc deploy: no more automatic resumes: {why}; run {outcome.run_id} stays "
              f"stopped after round {outcome.last_round}, its checkpoint in {out_dir}",
              file=sys.stderr, flush=True)
    return outcome


def cmd_submit(args: argparse.Namespace) -> int:
    progress("checking the run config")
    from common.methods import load_run_config, short_run_warning  # lazy: torch, 1.9 s of CPU
    if args.resume:
        merged = resume_submission(args.resume, args.preset, args.overrides)
        note = inexact_resume_note(merged)
        if note:
            print(f"fedefc deploy: {note}", flush=True)
    else:
        merged = merged_config(args.preset, args.overrides)
    if not merged.get("out-dir"):
        raise ConfigError("out-dir is required: an absolute folder on the SuperLink machine, "
                          "where the ServerApp writes; e.g. --set out-dir=\"/srv/fedefc/run1\"")
    cfg = load_run_config(merged)
    warning = short_run_warning(cfg)
    if warning:
        print(f"fedefc deploy: WARNING: {warning}", file=sys.stderr, flush=True)
    sign = None
    if args.sign_key:
        key = check_private(args.sign_key, "--sign-key")
        sign = (key, args.key_id or Path(key).name)
    env = flwr_env(default_flwr_home())
    progress(f"asking the SuperLink of connection {args.connection!r} (flwr ls)")
    listing = wait_for_superlink(args.connection, env, Path.cwd())
    refuse_a_busy_superlink(args.connection, env, Path.cwd(), listing)
    try:
        outcome = submit_resuming(args.connection, cfg.to_flat(), env, sign,
                                  args.max_resumes, args.reconnect_wait)
    except SuperLinkGone as gone:
        lost = superlink_lost_text(args.connection, gone.when,
                                   resume_command(args, cfg.out_dir))
        print(f"fedefc deploy: the run did not end here: {lost}", file=sys.stderr)
        return 1
    tell_run(cfg.out_dir)
    if outcome.degraded:
        print(f"fedefc deploy: run {outcome.run_id} completed DEGRADED: {outcome.degradation}."
              f"\nIts model and summary are in {cfg.out_dir} on the SuperLink machine; the "
              "summary's missed_rounds lists, per partition, the rounds it missed, and each "
              "round's record in metrics.jsonl says why (missing). Whole log: flwr log "
              f"{outcome.run_id} {args.connection}", file=sys.stderr)
        return EXIT_DEGRADED
    if not outcome.completed:
        explained = explain_failure(outcome, cfg.out_dir, args.connection,
                                    resume_command(args, cfg.out_dir))
        print(f"fedefc deploy: {explained}", file=sys.stderr)
        return 1
    print(f"run {outcome.run_id}: {outcome.status}; results in {cfg.out_dir} on the SuperLink "
          "machine (its SUMMARY line above counts client failures and rejected replies; "
          f"bring them here with: fedefc deploy fetch HOST:{cfg.out_dir} LOCAL_DIR)")
    return 0
