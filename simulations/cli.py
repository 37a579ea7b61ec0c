"""The ``fedshield`` command: one entry point, each subcommand's work lives with its package.

This module sits in ``simulations`` because it is the package allowed to import
all the others; heavy imports happen inside the handlers so ``--help`` is fast.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2
        self.exit(2, f"fedshield: error: {message}\n")


def _path(text: str) -> str:
    """A path argument: an empty one ('' from an unset shell variable) is refused, not read as the current directory."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"must be a path. Found {text!r}")
    return text


def _simulate(args: argparse.Namespace) -> int:
    from coordinator.rundir import check_run_dir, finished_summary, lock_run_dir, time_axis, time_label

    from coordinator.progress import result_text as _result

    from clients.client_app import torch_threads
    from clients.config import ConfigError, resolve_path

    from .runner import check_partitions, check_ray_cluster, run_scenario
    from .scenario import load_scenario, parse_override

    torch_threads()  # a bad FEDSHIELD_TORCH_THREADS is one line here too (the ClientApp would ignore it)
    # SIGTERM (``kill``, a scheduler's stop) ends the run as Ctrl-C does: "interrupted", the last
    # round's checkpoint kept, no traceback (its default action killed the process mid-write of the log).
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    overrides = dict(parse_override(s) for s in args.set or [])
    for flag, key, value in (("--rounds", "run.num-rounds", args.rounds), ("--engine", "simulation.engine", args.engine)):
        if value is not None:
            if key in overrides and overrides[key] != value:  # one of them would be dropped, silently
                raise ConfigError(f"{flag} and --set {key} must agree (or give one). Found {value!r} and "
                                       f"{overrides[key]!r}.")
            overrides[key] = value
    paths = args.scenario or [None]
    scenarios = [_in_file(p, len(paths) > 1, load_scenario, p, overrides) for p in paths]  # all checked before any runs
    from aggregation import get_device, kernels

    for scn in scenarios:  # the device (or FEDSHIELD_DEVICE) exists here: before a run directory is made or Ray starts
        get_device(scn.run.server.device, key="run.device")
    kernels.enabled()  # FEDSHIELD_KERNELS too (else found at the first aggregation)
    stamp = time.strftime('%Y%m%d-%H%M%S')
    if not args.verbose:
        import logging

        logging.getLogger("flwr").setLevel(logging.WARNING)
    if len(scenarios) == 1:
        scn = scenarios[0]
        # --run-dir, else the scenario's run-dir (its file or --set run.run-dir=...), else runs/NAME-STAMP
        run_dir = (resolve_path(args.run_dir, "--run-dir") if args.run_dir else _own_run_dir(scn)
                   or Path("runs") / f"{scn.sim.name}-{stamp}")
        runs = [(scn, run_dir)]
    else:  # a comparison: one run directory each under one parent, and one accuracy_vs_time.png over all
        parent = resolve_path(args.run_dir, "--run-dir") if args.run_dir else Path("runs") / f"compare-{stamp}"
        names = [s.sim.name if [t.sim.name for t in scenarios].count(s.sim.name) == 1 else f"{i}-{s.sim.name}"
                 for i, s in enumerate(scenarios)]
        # a scenario's own run-dir is used when --run-dir is not given (--set run.run-dir applies to all of them)
        runs = [(scn, (None if args.run_dir else _own_run_dir(scn)) or parent / name)
                for scn, name in zip(scenarios, names, strict=True)]
        dirs = [d.resolve() for _, d in runs]
        if len(set(dirs)) < len(dirs):
            from clients import ConfigError

            dup = next(d for d in dirs if dirs.count(d) > 1)
            raise ConfigError(f"run.run-dir must differ between the scenarios of a comparison. Found {str(dup)!r} "
                              "for two of them (--set applies to every scenario).")
    for (scn, _), path in zip(runs, paths, strict=True):
        _in_file(path, len(paths) > 1, check_partitions, scn)  # the data split for this many clients: before any run
    resumed = [check_run_dir(run_dir) for _, run_dir in runs]  # a file in the way or a bad checkpoint: before any run
    for (scn, run_dir), (_, ckpt) in zip(runs, resumed, strict=True):
        if ckpt is not None:  # another scenario's run there: refused, not resumed (nor reported as this one's result)
            _check_same_run(scn, ckpt, run_dir)
    for scn, _ in runs:
        check_ray_cluster(scn)  # a Ray cluster that does not answer: before any run too
    for _, run_dir in runs:
        lock_run_dir(run_dir)  # held until this process ends: no other run writes there meanwhile
    results = []
    labels = {}  # run directory -> its label in a comparison (unique, where the directories' own names may not be)
    for (scn, run_dir), (done, ckpt), label in zip(runs, resumed, names if len(runs) > 1 else [""], strict=True):
        labels[run_dir] = label
        wanted = scn.run.server.num_rounds
        finished = finished_summary(run_dir, done, wanted) if ckpt is not None else None
        if finished is not None:
            # Nothing to train: say so (exit 0, the run directory is left as it was) instead of announcing rounds.
            print(f"fedshield simulate: {run_dir} already holds {done} rounds (>= the {wanted} requested); nothing "
                  f"trained, its results are unchanged. Give --rounds N with N > {done} to train more.", file=sys.stderr)
            summary = {**finished, "run_dir": str(run_dir.resolve())}  # (its figures: the last row re-evaluated)
            results.append((run_dir, summary, 0.0))
            print(f"final {_result(summary)} after {done} rounds (none trained now); "
                  f"results in {summary['run_dir']}")
            continue
        resume = f" (resuming after round {done})" if done else ""
        print(f"fedshield simulate: scenario {scn.sim.name!r}, engine {scn.sim.engine}, "
              f"{scn.sim.num_supernodes} clients, {wanted} rounds{resume} -> {run_dir}", file=sys.stderr)
        start = time.monotonic()
        summary = run_scenario(scn, run_dir, show_progress=not args.quiet)
        wall = time.monotonic() - start
        results.append((run_dir, summary, wall))
        if summary.get("failure"):
            from coordinator import CoordinatorError

            raise CoordinatorError(f"{summary['failure']}; results in {summary['run_dir']}")
        print(f"final {_result(summary)} after {summary['rounds']} rounds; "
              f"wall time {wall:.1f} s; results in {summary['run_dir']}")
    if len(runs) > 1:
        from coordinator import RunDirectory
        from coordinator.rundir import TIME_PLOT

        histories = {labels[d]: (RunDirectory(d).load_checkpoint() or {}).get("history", []) for d, _, _ in results}
        RunDirectory(parent).plot_accuracy_vs_time(histories, "{metric} over time")
        for d, summary, wall in results:
            rows = histories[labels[d]]
            print(f"  {labels[d]:<28} {_result(summary).removeprefix('test ')}  time {time_axis(rows)[-1] if rows else 0:.1f} s "
                  f"({time_label([rows])})  wall {wall:.1f} s")
        print(f"comparison plot: {parent / TIME_PLOT}")
    return 0


def _own_run_dir(scn) -> Path | None:
    """The scenario's own run-dir (its file's, or --set run.run-dir=...), if it has one."""
    from clients.config import resolve_path

    return resolve_path(scn.run.server.run_dir, "run.run-dir") if scn.run.server.run_dir else None


def _check_same_run(scn, ckpt: dict, run_dir: Path) -> None:
    """CoordinatorError naming each setting in which ``run_dir``'s checkpoint differs from ``scn``."""
    from coordinator.workflow import check_resumable

    # (as every engine's; with edge aggregators the coordinator's nodes are the sites, each checking its own clients)
    check_resumable(scn.run, ckpt, run_dir, scn.sim.sites or scn.sim.num_supernodes, scn.sim.engine)


def _in_file(path: str | None, name_it: bool, fn, *args):
    """``fn(*args)``; a ConfigError it raises names the scenario file first when ``name_it`` (a
    comparison: otherwise nothing would say which of its files is wrong)."""
    from clients import ConfigError

    try:
        return fn(*args)
    except ConfigError as exc:
        where = str(path) if path is not None else "default scenario"
        if not name_it or str(exc).startswith(where):
            raise
        raise ConfigError(f"{where}: {exc}") from None


def _certs_init(args: argparse.Namespace) -> int:
    from privacy import init_certificates

    paths = init_certificates(args.dir, tuple(args.san or ()), force=args.force)
    print(f"wrote CA {paths.ca_cert}, server certificate {paths.server_cert} and key {paths.server_key}; the CA's own "
          f"key {paths.ca_cert.with_name('ca.key')} is needed by nothing that runs: move it off the coordinator's host "
          "(whoever holds it can pass for the coordinator to every agent)")
    return 0


def _keys_new(args: argparse.Namespace) -> int:
    from privacy import new_node_key

    priv, pub = new_node_key(args.path, force=args.force, curve=args.curve)
    print(f"wrote node key {priv} (keep private) and {pub} (enrol it in the coordinator config)")
    return 0


def _data_export(args: argparse.Namespace) -> int:
    from clients.cli import export_partitions

    for path in export_partitions(args.task, args.num_partitions, args.out, args.partitioning, args.alpha, args.seed):
        print(path)
    return 0


def _coordinator_start(args: argparse.Namespace) -> int:
    from coordinator.service import start_coordinator

    return start_coordinator(args.config, insecure=args.insecure, run_dir=args.run_dir)


def _aggregator_start(args: argparse.Namespace) -> int:
    from coordinator.aggregator import start_aggregator

    return start_aggregator(args.config, insecure=args.insecure)


def _agent_start(args: argparse.Namespace) -> int:
    from clients.cli import start_agent

    return start_agent(args)


def _privacy_plan(args: argparse.Namespace) -> int:
    from privacy import PrivacyEvent, available_accountants, calibrate_noise_multiplier, epsilon_of

    names = available_accountants() if args.accountant == "both" else (args.accountant,)
    plan = {name: calibrate_noise_multiplier(args.epsilon, args.delta, args.sampling_rate, args.rounds, accountant=name)
            for name in names}  # (a bad input is one error line before anything is printed)
    print(f"target epsilon {args.epsilon:g} at delta {args.delta:g}, {args.rounds} rounds at sampling rate "
          f"{args.sampling_rate:g} (Poisson; 1: every client every round):")
    for name, z in plan.items():
        spent = epsilon_of([PrivacyEvent(args.sampling_rate, z, args.rounds)], args.delta, name)
        print(f"  {name}: noise multiplier {z:.4f} (spends epsilon {spent:.4f})")
    if len(plan) == 2:
        print(f"pld needs {1 - plan['pld'] / plan['rdp']:.1%} less noise than rdp for the same guarantee")
    return 0


def _runs(args: argparse.Namespace) -> int:
    from .reports import ReportError, format_runs, list_runs

    try:
        runs = list_runs(args.dir)
    except ReportError as exc:
        print(f"fedshield: error: {exc}", file=sys.stderr)
        return 2
    if not runs:
        print(f"fedshield runs: no run directories under {args.dir} (none holds summary.json, checkpoint.pt or status.json)",
              file=sys.stderr)
        return 0
    print(format_runs(runs, args.dir))
    return 0


def _report(args: argparse.Namespace) -> int:
    from .reports import ReportError, report

    try:
        text = report(args.run_dir, plots=not args.no_plots)
    except ReportError as exc:
        print(f"fedshield: error: {exc}", file=sys.stderr)
        return 2
    print(text)
    return 0


def _positive(kind):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a {'number' if kind is float else 'whole number'} > 0. "
                                             f"Found {text!r}") from None
        if not value > 0 or value == float("inf"):
            raise argparse.ArgumentTypeError(f"must be > 0 and finite. Found {text!r}")
        return value
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="fedshield", description="Federated, privacy-preserving learning on Flower.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    s = sub.add_parser("simulate", help="run a scenario on one machine (Flower's simulation engine, fedshield's "
                       "in-process Grid or its virtual clock; or on a Ray cluster)")
    s.add_argument("scenario", nargs="*", help="scenario TOML (default: the packaged default scenario); several: "
                   "a comparison, one run each and one accuracy_vs_time.png over all")
    s.add_argument("--engine", choices=["flower", "inprocess", "virtual"],
                   help="override the scenario's engine (virtual: simulated time from device tiers)")
    s.add_argument("--run-dir", type=_path, help="results directory (default: runs/NAME-TIMESTAMP); an existing one resumes")
    s.add_argument("--rounds", type=int, help="override run.num-rounds")
    s.add_argument("--set", action="append", metavar="TABLE.KEY=VALUE", help="override any scenario key")
    s.add_argument("--quiet", action="store_true", help="no live progress")
    s.add_argument("--verbose", action="store_true", help="show Flower's log")
    s.set_defaults(func=_simulate)

    certs = sub.add_parser("certs", help="TLS certificates").add_subparsers(dest="action", required=True, parser_class=_Parser)
    ci = certs.add_parser("init", help="make a CA and a server certificate (SAN localhost, 127.0.0.1)")
    ci.add_argument("dir", type=_path)
    ci.add_argument("--san", action="append", help="extra DNS name or IP for the server certificate")
    ci.add_argument("--force", action="store_true")
    ci.set_defaults(func=_certs_init)

    keys = sub.add_parser("keys", help="node authentication keys").add_subparsers(dest="action", required=True, parser_class=_Parser)
    kn = keys.add_parser("new", help="make a client key pair DIR/NAME and DIR/NAME.pub (ECDSA, OpenSSH)")
    kn.add_argument("path", type=_path)
    kn.add_argument("--curve", choices=("p256", "p384"), default="p256",
                    help="NIST curve (default: %(default)s; the SuperLink verifies a P-256 signature 4x faster)")
    kn.add_argument("--force", action="store_true")
    kn.set_defaults(func=_keys_new)

    data = sub.add_parser("data", help="client data files").add_subparsers(dest="action", required=True, parser_class=_Parser)
    de = data.add_parser("export", help="write a task's partitions as client-K.npz files (for agents' --data)")
    de.add_argument("--task", default="digits", help="digits, synthetic, package.module:Class or file.py:Class "
                    "(default: %(default)s)")
    de.add_argument("--num-partitions", type=int, required=True)
    de.add_argument("--out", required=True, type=_path, help="directory for client-K.npz (made if missing)")
    de.add_argument("--partitioning", default="dirichlet", help="dirichlet (label skew) or iid (default: %(default)s)")
    de.add_argument("--alpha", type=float, default=0.5, help="Dirichlet concentration: smaller, more skew "
                    "(default: %(default)s)")
    de.add_argument("--seed", type=int, default=0, help="the split's seed, as run.data-seed (default: %(default)s)")
    de.set_defaults(func=_data_export)

    co = sub.add_parser("coordinator", help="the coordinator service").add_subparsers(dest="action", required=True, parser_class=_Parser)
    cs = co.add_parser("start", help="start a SuperLink (TLS, node auth) and run fedshield's ServerApp on it")
    cs.add_argument("--config", required=True, type=_path, help="coordinator TOML")
    cs.add_argument("--insecure", action="store_true", help="NO TLS and no node authentication (testing only)")
    cs.add_argument("--run-dir", type=_path, help="override [run] run-dir (relative to the working directory)")
    cs.set_defaults(func=_coordinator_start)

    agg = sub.add_parser("aggregator", help="an edge aggregator between the coordinator and a site's agents"
                         ).add_subparsers(dest="action", required=True, parser_class=_Parser)
    ags = agg.add_parser("start", help="a site SuperLink for its agents, one node to the coordinator above")
    ags.add_argument("--config", required=True, type=_path, help="aggregator TOML: [coordinator] (the site's SuperLink), "
                     "[run] (the site's round), [upstream] (the coordinator above)")
    ags.add_argument("--insecure", action="store_true", help="NO TLS and no node authentication, above and below "
                     "(testing only)")
    ags.set_defaults(func=_aggregator_start)

    ag = sub.add_parser("agent", help="the client agent").add_subparsers(dest="action", required=True, parser_class=_Parser)
    ast = ag.add_parser("start", help="start a SuperNode running fedshield's ClientApp")
    ast.add_argument("--coordinator", required=True, metavar="HOST:PORT")
    ast.add_argument("--root-cert", type=_path, help="the coordinator's CA certificate (ca.crt)")
    ast.add_argument("--key", type=_path, help="this node's private key (from `fedshield keys new`)")
    ast.add_argument("--task", help="the task this node trains: package.module:Class or file.py:Class (its model, "
                     "loss and training loop run here; default: the built-in tasks only)")
    ast.add_argument("--data", type=_path, help="this node's data (.npz with x, or named inputs x.NAME, and y)")
    ast.add_argument("--eval-data", type=_path, help="this node's held-out data for federated evaluation (.npz "
                     "as --data; with --data)")
    ast.add_argument("--partition", metavar="ID/N", help="use partition ID of N of the task's built-in data instead of --data")
    ast.add_argument("--port", type=int, default=0,
                     help="the SuperNode's local Runtime API port, for its worker (default 0: each node binds a free one)")
    ast.add_argument("--link-mbps", type=float, default=0.0,
                     help="this device's uplink in Mbit/s, reported to the coordinator (slow links get a compressing codec)")
    ast.add_argument("--state-dir", type=_path,
                     help="where this device keeps its local-DP ledger across runs and restarts (default: "
                          "$FEDSHIELD_AGENT_STATE_DIR, else ~/.fedshield/agent)")
    ast.add_argument("--min-local-noise", type=float, default=0.0, metavar="Z",
                     help="train only under local DP with a noise multiplier >= Z (refuse the coordinator otherwise)")
    ast.add_argument("--max-local-epsilon", type=float, default=0.0, metavar="EPS",
                     help="refuse a round that would take this data's local-DP epsilon past EPS (0: no limit)")
    ast.add_argument("--insecure", action="store_true", help="NO TLS (testing only)")
    ast.add_argument("--max-retries", type=int, default=3, help="connection attempts before giving up")
    ast.add_argument("--rejoin", action="store_true",
                     help="stay up when the coordinator goes away or refuses this node (its run ends, it restarts "
                          "and resumes, a key is enrolled later): try again, backing off to once a minute, the "
                          "ClientApp worker kept warm up to --release-worker-after (default: the agent stops with the coordinator's "
                          "run)")
    ast.add_argument("--poll-interval", type=float, default=0.2, metavar="S",
                     help="seconds between this node's requests for work (default: %(default)s)")
    ast.add_argument("--idle-poll-interval", type=float, default=None, metavar="S",
                     help="after 10 s without work the requests back off, doubling, to one every S seconds "
                          "(default: 3, Flower's SuperNode's, or --poll-interval if longer)")
    ast.add_argument("--task-timeout", type=float, default=1800.0, metavar="S",
                     help="a message handled longer than this is answered with an error and the ClientApp "
                          "worker restarted (default: %(default)s)")
    ast.add_argument("--release-worker-after", type=float, default=600.0, metavar="S",
                     help="after S seconds without a message the ClientApp worker exits, freeing its memory "
                          "(torch, the task and its data: ~290 MB of the agent's ~410), and the next message "
                          "starts it again (a cold start: seconds); 0: keep it warm (default: %(default)s)")
    ast.add_argument("--site-socket", help=argparse.SUPPRESS)  # an edge aggregator's upward agent (aggregator start)
    ast.set_defaults(func=_agent_start)

    priv = sub.add_parser("privacy", help="differential privacy planning").add_subparsers(dest="action", required=True,
                                                                                          parser_class=_Parser)
    pp = priv.add_parser("plan", help="the smallest noise multiplier that keeps a run within (epsilon, delta)")
    pp.add_argument("--epsilon", type=_positive(float), required=True, help="target epsilon")
    pp.add_argument("--delta", type=_positive(float), default=1e-5, help="target delta (default 1e-5)")
    pp.add_argument("--rounds", type=_positive(int), required=True, help="rounds (or steps) the run will take")
    pp.add_argument("--sampling-rate", type=_positive(float), required=True,
                    help="each client's probability of taking part in a round (fraction-train; 1 under distributed DP)")
    pp.add_argument("--accountant", choices=("pld", "rdp", "both"), default="both",
                    help="which accountant to plan with (default: both, side by side)")
    pp.set_defaults(func=_privacy_plan)

    rs = sub.add_parser("runs", help="list the run directories under DIR with their status and final figures")
    rs.add_argument("dir", nargs="?", default="runs", type=_path, metavar="DIR", help="where to look (default: %(default)s)")
    rs.set_defaults(func=_runs)
    rp = sub.add_parser("report", help="summarise one run directory and write its plots again")
    rp.add_argument("run_dir", type=_path, metavar="RUN_DIR")
    rp.add_argument("--no-plots", action="store_true", help="print the summary only; leave the plots as they are")
    rp.set_defaults(func=_report)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    if not (sys.argv[1:] if argv is None else argv):  # bare `fedshield`: what it does, not only a missing argument
        parser.print_help(sys.stderr)
        return 2
    args = parser.parse_args(argv)  # --help and usage errors need no heavy import
    from aggregation import AggregationError
    from clients import ClientError
    from coordinator import CoordinatorError
    from privacy import PrivacyError

    try:
        return int(args.func(args) or 0)
    except (ClientError, CoordinatorError, AggregationError, PrivacyError) as exc:
        print(f"fedshield: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a file-system problem no handler turned into a clearer line
        where = f"{exc.filename}: " if exc.filename else ""
        if exc.filename2:
            where = f"{exc.filename} -> {exc.filename2}: "
        print(f"fedshield: error: {where}{exc.strerror or exc}.", file=sys.stderr)
        return 2
    except UnicodeDecodeError as exc:  # a file that should be text is not UTF-8
        print(f"fedshield: error: a file must be UTF-8 text. Found byte 0x{exc.object[exc.start]:02x} at offset "
              f"{exc.start} ({exc.reason}).", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("fedshield: interrupted", file=sys.stderr)
        return 130


def entry() -> None:
    """The ``fedshield`` console script: ``main``, then the exit. After an interrupt, threads a library left
    running (a Flower worker blocked in ray.get for a result that never comes, seen under load) get a bounded
    time to end; then the process exits anyway: the interpreter's exit would wait on them for ever."""
    code = main()
    if code == 130:
        import os
        import threading

        deadline = time.monotonic() + 15.0
        try:
            for thread in threading.enumerate():
                if thread is not threading.main_thread() and not thread.daemon:
                    thread.join(max(0.0, deadline - time.monotonic()))
            stuck = any(t.is_alive() and not t.daemon and t is not threading.main_thread() for t in threading.enumerate())
        except KeyboardInterrupt:  # a second Ctrl-C (or SIGTERM) while waiting: out now, without a traceback
            stuck = True
        if stuck:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
