"""``fedefc``: every command a user types, in one argparse tree.

    fedefc run [PRESET] [--set KEY=VALUE ...]       one simulation job (flwr run)
    fedefc resume OUT_DIR [--set rounds=N]          continue an interrupted job
    fedefc presets                                  list configs/*.toml
    fedefc grid run|report|list GRID [--set ...]    the experiment runner
    fedefc results table|fetch|docs ...             grid tables; run folders out of git
    fedefc deploy superlink|supernode|service|connection|register|submit|fetch|
                  renew-cert|export ...
                                                    a deployment across machines
    fedefc data SOURCE OUT --size N                 a folder of images -> a node's data.npz
    fedefc labels DATA.npz [--per-class N]          check labels in the browser -> verified
    fedefc labels DATA.npz --suspects MODEL         the likeliest wrong labels first -> reviewed

Bad input exits 2 before anything starts; a failed run exits 1, a degraded one 3
(:mod:`.errors`).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from . import (
    deploy_export,
    deploy_submit,
    deploy_supervisor,
    flower,
    keys_doc,
    labels,
    prepare_data,
    services,
)
from .errors import EXIT_DEGRADED, UsageError, exit_code
from .raw_archive import MANIFEST, RESULTS_HOME, fetch, grid_key, manifests, tables_dir
from .ray_cluster import check_reachable, ray_address
from .run_configs import (
    CONFIGS_DIR,
    inexact_resume_note,
    preset_names,
    resolve_run_config,
    resume_config,
)


def _unwind_on_signals() -> None:
    """SIGTERM/SIGHUP unwind the stack, so every Flower process we started is stopped."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _exit_on_signal)


def _exit_on_signal(signum, _frame) -> None:
    raise SystemExit(128 + signum)


def cmd_run(args: argparse.Namespace) -> int:
    """``fedefc run`` and ``fedefc resume``: one job, told in a few lines at the end
    (:func:`fedefc_server.summary.run_report`)."""
    import torch  # lazy: torch, 1.9 s of CPU

    from common.methods import load_run_config, short_run_warning  # lazy: torch, 1.9 s of CPU
    from fedefc_server.summary import run_report  # lazy: torch, 1.9 s of CPU

    from .simulation import preflight_in_child, run_simulation_job  # lazy: torch, 1.9 s of CPU
    _unwind_on_signals()
    if args.command == "resume":
        run_config = resume_config(args.folder, args.overrides)
        note = inexact_resume_note(run_config)
        if note:
            print(f"fedefc: {note}", flush=True)
    else:
        run_config = resolve_run_config(args.preset, args.overrides, args.out_dir)
    warning = short_run_warning(load_run_config(run_config))
    if warning:
        print(f"fedefc: WARNING: {warning}", flush=True)
    if args.ray_address:
        check_reachable(args.ray_address)
    preflight_in_child(run_config)
    gpus = args.client_gpus
    if gpus is None:
        gpus = 0.25 if torch.cuda.is_available() and run_config["device"] != "cpu" else 0.0
    print(f"fedefc: results -> {run_config['out-dir']}", flush=True)
    summary = run_simulation_job(run_config, args.client_cpus, gpus, checked=True,
                                 ray_address=args.ray_address)
    print("\n".join(run_report(summary)))  # the whole summary: summary.json
    if summary.get("status") == "degraded":
        print(f"fedefc: the run is DEGRADED: {summary['degraded']}", file=sys.stderr)
        return EXIT_DEGRADED
    return 0


def cmd_presets(args: argparse.Namespace) -> int:
    for name in preset_names():
        print(name)
    return 0


def cmd_keys(args: argparse.Namespace) -> int:
    """``fedefc keys [--write | --check]``: the run-config keys in tiers (docs/RUN-CONFIG.md)."""
    if args.write and args.check:
        raise UsageError("--write and --check: give one (--check writes nothing)")
    text, stale = keys_doc.keys_doc(write=args.write)
    if args.write or args.check:
        print(f"{'stale' if args.check and stale else 'wrote' if stale else 'up to date'} "
              f"{keys_doc.DOC}")
        return 1 if args.check and stale else 0
    print(text, end="")
    return 0


def cmd_grid(args: argparse.Namespace) -> int:
    """``fedefc grid run|report|list``; run and report write the summary table, its
    manifest and the tables from it (:mod:`.run_table`, :mod:`.report`) where
    :func:`.raw_archive.tables_dir` says, and the plots beside the runs."""
    from .grid import Grid, run_grid  # lazy: torch, 1.9 s of CPU
    from .report import write_plots, write_report  # lazy: torch, 1.9 s of CPU
    from .run_table import RUNS_FILE, missing_runs, publish, table_runs  # lazy: torch, 1.9 s
    _unwind_on_signals()
    results_dir = Path(args.results_dir).expanduser().resolve()
    grid = Grid.load(args.grid)
    raw, tables = results_dir / grid.name, tables_dir(results_dir) / grid.name
    if args.action == "list":
        for cell in grid.cells(results_dir, args.overrides):
            print(f"{'done' if cell.done else 'todo'}  {cell.out_dir}")
        return 0
    here = any(raw.rglob("summary.json"))
    missing = missing_runs(raw, tables)
    if missing and (here or args.action == "run"):
        key = grid_key(tables)
        raise UsageError(f"{tables / RUNS_FILE} holds {len(missing)} runs that {raw} lacks "
                         f"(e.g. {missing[0]}): fetch them first (fedefc results fetch {key} "
                         f"puts them in {RESULTS_HOME / key}), or use another --results-dir")
    failures = 0
    if args.action == "run":
        if args.ray_address:
            check_reachable(args.ray_address)
        failures = run_grid(grid, results_dir, args.overrides, args.max_cells,
                            args.client_cpus, args.client_gpus, rows=args.rows,
                            ray_address=args.ray_address, seeds=args.seeds)
        here = any(raw.rglob("summary.json"))
    written = []
    if here:  # the runs are here: their table, manifest and plots anew
        records = publish(raw, tables, grid)
        written += [tables / RUNS_FILE, tables / MANIFEST]
        written += write_plots(grid, grid.cells(results_dir, args.overrides), raw)
    else:  # only the summary table: the tables from it
        records = table_runs(tables)
    for path in [*write_report(grid, records, tables), *written]:
        print(f"wrote {path}")
    return 1 if failures else 0


def cmd_results(args: argparse.Namespace) -> int:
    """``fedefc results table|fetch|docs`` (docs/RESULTS.md, "Where the runs are")."""
    if args.action == "fetch":
        to = Path(args.to).expanduser().resolve()
        archive = Path(args.archive).expanduser().resolve() if args.archive else None
        for entry in manifests(args.grid):
            dest = to / entry["grid"]
            got = fetch(entry, dest, archive)
            print(f"fetched {entry['grid']}: {got['files']} files, {got['bytes']} bytes, "
                  f"sha256 {got['sha256']} as the manifest records -> {dest}")
        return 0
    if args.action == "docs":
        from .results_docs import DOCS, render_docs  # lazy: torch, 1.9 s of CPU
        stale = [doc for doc in DOCS if render_docs(doc, write=not args.check)]
        for doc in stale:
            print(f"{'stale' if args.check else 'wrote'} {doc}")
        return 1 if args.check and stale else 0
    from .grid import Grid  # lazy: torch, 1.9 s of CPU
    from .report import write_report  # lazy: torch, 1.9 s of CPU
    from .run_table import RUNS_FILE, publish  # lazy: torch, 1.9 s of CPU
    raw = Path(args.folder).expanduser().resolve()
    tables = tables_dir(raw.parent) / raw.name
    name = args.grid or raw.name
    grid = Grid.load(name) if args.grid or (CONFIGS_DIR / "grids" / f"{name}.toml").exists() \
        else None
    records = publish(raw, tables, grid)
    for path in [tables / RUNS_FILE, tables / MANIFEST,
                 *(write_report(grid, records, tables) if grid else [])]:
        print(f"wrote {path}")
    return 0


def _overrides(parser: argparse.ArgumentParser, example: str = "rho=0.4") -> None:
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE",
                        help=f"override a run-config key (repeatable), e.g. --set {example}")


def _resources(parser: argparse.ArgumentParser, gpu_default: float | None) -> None:
    parser.add_argument("--client-cpus", type=int, default=1, help="CPUs per simulated client")
    parser.add_argument("--client-gpus", type=float, default=gpu_default,
                        help="GPUs per simulated client" + (
                            " (default 0.25 when CUDA is visible, else 0)"
                            if gpu_default is None else ""))
    parser.add_argument("--ray-address", type=ray_address, default=None, metavar="HOST:PORT",
                        help="run the clients on the nodes of this running Ray cluster (the "
                        "address `ray start --head` printed; docs/BENCHMARKS.md, \"Past one "
                        "box: a Ray cluster\"); default: a private Ray on this machine")


def _count(text: str) -> int:
    """A whole number >= 0 (argparse type), or an error naming the value and the fix."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 0; e.g. 3, or "
                                         "0 to turn it off")
    return value


def _seconds(text: str) -> float:
    """A number of seconds > 0 (argparse type), or an error naming the value and the fix."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds > 0; e.g. "
                                         "600")
    return value


def _preset(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("preset", nargs="?", default=None,
                        help="configs/<preset>.toml name or a .toml path "
                             "(default: the pyproject.toml defaults)")


def _trusted_keys(parser: argparse.ArgumentParser, apps: str) -> None:
    parser.add_argument("--trusted-keys", help=f"run only {apps} signed by a key in this file "
                        "(Flower's --trusted-entities YAML, from deploy/gen-signing-key.sh; "
                        "docs/DEPLOYMENT.md, \"Outsiders on the network\")")


def _superlink_args(link: argparse.ArgumentParser) -> None:
    link.add_argument("--host", required=True,
                      help="the address to serve on: 127.0.0.1 to try it on one machine; the "
                           "interface the SuperNodes reach (e.g. 203.0.113.7), or 0.0.0.0 for "
                           "all, in a deployment (docs/DEPLOYMENT.md, \"Ports\")")
    link.add_argument("--port", type=int, default=8000,
                      help="the one port of the Fleet, Control and Runtime APIs")
    link.add_argument("--state-dir", default=None,
                      help="its folder: database (node registrations), FLWR_HOME, and the "
                           "logs superlink.log and superexec.log (default ~/.fedefc/superlink)")
    link.add_argument("--certs", help="folder written by deploy/gen-certs.sh (enables TLS)")
    link.add_argument("--node-auth", action="store_true",
                      help="accept registered SuperNodes only (needs --certs)")
    link.add_argument("--superexec-secret", help="shared-secret file (deploy/gen-secret.sh; "
                      "owner-only): only a SuperExec holding it may run ServerApps")
    link.add_argument("--allow-insecure", action="store_true",
                      help="serve without TLS on a non-loopback host (trusted network only)")
    _trusted_keys(link, "ServerApps")


def _supernode_args(node: argparse.ArgumentParser) -> None:
    node.add_argument("--superlink", required=True, help="SuperLink address host:port")
    node.add_argument("--partition-id", type=int, required=True,
                      help="this node's identity (and its partition without --data-path)")
    node.add_argument("--num-partitions", type=int, required=True,
                      help="the run's num-clients")
    node.add_argument("--data-path", help="private data: an .npz or an ImageFolder directory")
    node.add_argument("--cache-dir", default=None,
                      help="prepared-data cache (default "
                           f"{deploy_supervisor.DEFAULT_CACHE_DIR}; for a service "
                           "STATE_DIR/cache)")
    node.add_argument("--ca-cert", help="the SuperLink's CA certificate (enables TLS)")
    node.add_argument("--auth-key", help="this node's private key (deploy/gen-node-keys.sh; "
                      "owner-only); its public key KEY.pub must be registered")
    node.add_argument("--superexec-secret", help="shared-secret file for this node's SuperExec "
                      "(deploy/gen-secret.sh; owner-only; one per node)")
    node.add_argument("--runtime-port", type=int, default=0,
                      help="local Runtime API port, served on 127.0.0.1 only (default: a free "
                           "port, so several nodes can share a host)")
    node.add_argument("--state-dir", default=None,
                      help="its folder: FLWR_HOME and the logs supernode.log and superexec.log "
                           "(default ~/.fedefc/supernode-PARTITION_ID)")
    _trusted_keys(node, "ClientApps")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="fedefc", description="FedEFC on Flower.")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser("run", help="run one simulation job (flwr run)")
    _preset(run)
    _overrides(run)
    run.add_argument("--out-dir", default=None,
                     help="results folder (made absolute; must be unused)")
    _resources(run, None)
    run.set_defaults(func=cmd_run)

    res = sub.add_parser("resume", help="continue an interrupted run from its checkpoint")
    res.add_argument("folder", help="the out-dir of the run to continue")
    _overrides(res, "rounds=200")
    _resources(res, None)
    res.set_defaults(func=cmd_run)

    sub.add_parser("presets", help="list the presets in configs/").set_defaults(
        func=cmd_presets)

    keys = sub.add_parser("keys", help="print every run-config key with its default, in "
                          "three tiers (docs/RUN-CONFIG.md, written from pyproject.toml)")
    keys.add_argument("--write", action="store_true", help="write docs/RUN-CONFIG.md")
    keys.add_argument("--check", action="store_true",
                      help="write nothing; exit 1 where docs/RUN-CONFIG.md differs")
    keys.set_defaults(func=cmd_keys)

    grid = sub.add_parser("grid", help="run, tabulate or list a grid of runs")
    grid.add_argument("action", choices=["run", "report", "list"])
    grid.add_argument("grid", help="configs/grids/<name>.toml name or a grid file path")
    _overrides(grid, "data-dir=/data")
    grid.add_argument("--results-dir", default=str(RESULTS_HOME),
                      help="where the run folders go, <results-dir>/<grid>/ (default "
                      "~/fedefc-results: their summary table then goes to this checkout's "
                      "results/<grid>/, docs/RESULTS.md, \"Where the runs are\")")
    grid.add_argument("--max-cells", type=int, default=None, help="run at most this many cells")
    grid.add_argument("--row", dest="rows", action="append", default=None, metavar="LABEL",
                      help="run only the cells of this row (repeatable; the report covers "
                      "every row)")
    grid.add_argument("--seed", dest="seeds", action="append", type=int, default=None,
                      metavar="N", help="run only the cells of this seed (repeatable): one "
                      "seed of every row at a time, so that paired rows finish together")
    _resources(grid, 0.0)
    grid.set_defaults(func=cmd_grid)

    results = sub.add_parser("results", help="the grids' summary tables and their run "
                             "folders outside git (docs/RESULTS.md, \"Where the runs are\")")
    rsub = results.add_subparsers(dest="action", required=True, metavar="ACTION")
    table = rsub.add_parser("table", help="write the summary table and manifest of a grid "
                            "folder of run folders (git's, or an archive written beside it)")
    table.add_argument("folder", help="a grid's folder, e.g. results/cross-silo")
    table.add_argument("--grid", help="its grid file, for the row labels and tables "
                       "(default: configs/grids/<folder name>.toml where there is one)")
    fetch_ = rsub.add_parser("fetch", help="bring a grid's run folders back, checked "
                             "against the sha256 its manifest records")
    fetch_.add_argument("grid", help="a grid under results/ (e.g. cross-silo, "
                        "clean-labels/cross-silo) or a folder of grids (clean-labels)")
    fetch_.add_argument("--to", default=str(RESULTS_HOME), help="the results directory: "
                        "the runs go to <to>/<grid>/, which must be new (default "
                        "~/fedefc-results, where fedefc grid report looks)")
    fetch_.add_argument("--archive", help="the grid's archive, for a grid whose manifest "
                        "names one (default: beside the folder it unpacks to)")
    docs = rsub.add_parser("docs", help="rewrite the tables of docs/RESULTS.md from the "
                           "summary tables")
    docs.add_argument("--check", action="store_true",
                      help="write nothing; exit 1 where a doc differs from what it would be")
    results.set_defaults(func=cmd_results)

    dep = sub.add_parser("deploy", help="run FedEFC across machines (docs/DEPLOYMENT.md)")
    dsub = dep.add_subparsers(dest="deploy_command", required=True, metavar="DEPLOY_COMMAND")
    link = dsub.add_parser("superlink", help="the SuperLink and its SuperExec (foreground)")
    _superlink_args(link)
    link.set_defaults(func=deploy_supervisor.cmd_superlink)

    node = dsub.add_parser("supernode", help="a SuperNode and its SuperExec (foreground)")
    _supernode_args(node)
    node.set_defaults(func=deploy_supervisor.cmd_supernode)

    service = dsub.add_parser("service", help="write systemd units for the SuperLink or a "
                              "SuperNode (the same flags as superlink / supernode)")
    roles = service.add_subparsers(dest="role", required=True, metavar="ROLE")
    for role, add in (("superlink", _superlink_args), ("supernode", _supernode_args)):
        unit = roles.add_parser(role, help=f"units for the {role} and its SuperExec")
        add(unit)
        unit.add_argument("--user", required=True,
                          help="the dedicated system user the services run as (not root)")
        unit.add_argument("--units-dir", required=True,
                          help="where to write the .service files (then copied to "
                               "/etc/systemd/system)")
        unit.set_defaults(func=services.cmd_service)

    conn = dsub.add_parser("connection", help="add a SuperLink connection for the flwr CLI")
    conn.add_argument("name")
    conn.add_argument("address", help="host:port of the SuperLink")
    conn.add_argument("--ca-cert", help="CA certificate (TLS); without it: insecure")
    conn.add_argument("--flwr-home", help="default: $FLWR_HOME or ~/.flwr")
    conn.set_defaults(func=deploy_submit.cmd_connection)

    reg = dsub.add_parser("register", help="register SuperNode public keys (--node-auth)")
    reg.add_argument("connection", help="a connection to the SuperLink, with TLS")
    reg.add_argument("public_keys", nargs="+", metavar="PUBLIC_KEY",
                     help="NAME.pub files written by deploy/gen-node-keys.sh")
    reg.set_defaults(func=deploy_submit.cmd_register)

    submit = dsub.add_parser(
        "submit", help="run the app on a connection (or resume a run: --resume OUT_DIR); "
        "exit 1 unless it completed, 3 if it completed degraded",
        description="Run the app on a connection and follow its log; exit 0 once it "
        "completed, 1 if it failed, 3 if it completed degraded (a site missed more rounds "
        "than max-missed-share allows). A run whose ServerApp was stopped from outside "
        "after a recorded round (its SuperExec or the SuperLink exited and was restarted "
        "mid-run) is resumed on its own, up to --max-resumes times; to resume one that "
        "stopped otherwise, submit it again with --resume OUT_DIR: it continues after the "
        "last round its checkpoint holds (docs/DEPLOYMENT.md, \"Resuming a run\").")
    submit.add_argument("connection")
    _preset(submit)
    _overrides(submit, 'out-dir="/srv/fedefc/run1"')
    submit.add_argument("--resume", metavar="OUT_DIR",
                        help="resume the run whose out-dir is OUT_DIR (absolute, on the "
                        "SuperLink machine) after its last checkpointed round, with its own "
                        "config.json where OUT_DIR is on this machine (else the preset and "
                        "--set given, which must be the run's); --set may change rounds, "
                        "client-timeout, wait-for-nodes, max-missed-share")
    submit.add_argument("--max-resumes", type=_count, default=3, metavar="N",
                        help="resume a run whose ServerApp was stopped from outside (its "
                        "SuperExec or the SuperLink exited and was restarted) after a "
                        "recorded round on its own, at most N times (default 3; 0: never)")
    submit.add_argument("--reconnect-wait", type=_seconds, default=flower.RECONNECT_S,
                        metavar="SECONDS", help="how long to wait for a SuperLink that "
                        "stopped answering mid-run (it crashed and its supervisor or "
                        "systemd starts it again) before giving up with how to resume the "
                        f"run (default {flower.RECONNECT_S:.0f})")
    submit.add_argument("--sign-key", help="the coordinator's signing key "
                        "(deploy/gen-signing-key.sh; owner-only): sign the app and this run's "
                        "config for machines started with --trusted-keys")
    submit.add_argument("--key-id", help="the key's name in the trusted keys file (default: "
                        "the key file's name)")
    submit.set_defaults(func=deploy_submit.cmd_submit)

    fetch = dsub.add_parser("fetch", help="bring a run's results (out-dir) to this machine")
    fetch.add_argument("source", help="[user@]host:/abs/out-dir on the SuperLink machine "
                       "(copied with scp), or a local path")
    fetch.add_argument("dest", help="a new local folder")
    fetch.set_defaults(func=deploy_export.cmd_fetch)

    export = dsub.add_parser("export", help="write each partition as private data")
    export.add_argument("out_dir", help="gets node-K/data.npz for every partition K")
    export.add_argument("--images", action="store_true",
                        help="write node-K/<class>/<n>.png and classes.json instead: a "
                        "folder of images per node, for fedefc data")
    _preset(export)
    _overrides(export)
    export.set_defaults(func=deploy_export.cmd_export)

    prepare_data.add_parser(sub)
    labels.add_parser(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except BrokenPipeError:  # our reader stopped (`fedefc grid list | head`): not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as err:
        code = exit_code(err)
        if code is None:
            raise
        print(f"fedefc: error: {err}", file=sys.stderr)
        return code


if __name__ == "__main__":
    sys.exit(main())
