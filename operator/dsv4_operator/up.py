"""`dsv4 up`: a Dsv4Deployment as a prefill/decode cluster of processes on 127.0.0.1.

    dsv4 up                         # the bundled CPU example on the bundled demo model
    dsv4 up -f dep.yaml             # any spec whose model is on this machine
    dsv4 up --ports free            # free ports instead of the spec's (offset per server)

It starts the prefill and decode servers with the arguments the operator gives their pods
(`dsv4_operator.local` names every difference), prints one line per state change while they load,
starts the router once they are healthy, and prints the endpoint when the router has its servers.
SIGINT or SIGTERM drains: the servers get SIGTERM and finish their in-flight requests, then the
router stops; the exit status is 0. A process that dies stops the rest; the exit status is 1 and
its last log lines are printed. Each process logs to <log dir>/<name>.log.

This module is the command line and the model it serves; up_cluster.py supervises the processes,
up_process.py is one of them.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from collections.abc import Mapping
from pathlib import Path

import yaml

from dsv4_operator import local as lc
from dsv4_operator.spec import Dsv4Deployment, SpecError, parse
from dsv4_operator.up_cluster import Cluster, build

EXIT_INVALID = 2
BUNDLED_SPEC = Path(__file__).with_name("data") / "cpu-tiny.yaml"


# ---- the model -------------------------------------------------------------------------------------


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dsv4"


def is_checkpoint(path: Path) -> bool:
    return (path / "config.json").is_file()


def resolve_model(dep: Dsv4Deployment) -> str:
    """The checkpoint directory to serve; the bundled example's model is the bundled demo checkpoint
    (dsv4_engine.demo: the tiny architecture trained to write like the Python docs)."""
    path, fieldname = lc.model_source(dep)
    if is_checkpoint(Path(path)):
        return path
    if dep.spec.model == load(BUNDLED_SPEC).spec.model:
        from dsv4_engine import demo

        try:
            return str(demo.bundled())
        except (OSError, RuntimeError) as e:  # a damaged install: say so, not a traceback
            raise lc.LocalError([(fieldname, str(e))]) from e
    hint = "dsv4 up reads the model from this machine: point spec.model.hostPath.path at a checkpoint"
    raise lc.LocalError([(fieldname, f"no checkpoint at {path} (no config.json); {hint}")])


# ---- the command line ------------------------------------------------------------------------------


def load(path: Path) -> Dsv4Deployment:
    docs = [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d is not None]
    if len(docs) != 1:
        raise SpecError([("(root)", f"expected one Dsv4Deployment in the file, found {len(docs)}")])
    return parse(docs[0])


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="dsv4 up",
        description="Run a Dsv4Deployment as a prefill/decode cluster of processes on 127.0.0.1.",
    )
    ap.add_argument(
        "-f", "--filename", type=Path, help="Dsv4Deployment YAML (default: the bundled CPU example)"
    )
    ap.add_argument(
        "--ports",
        choices=("spec", "free"),
        default="spec",
        help="spec: the spec's ports, offset per server (default); free: ports the kernel hands out",
    )
    ap.add_argument("--log-dir", type=Path, help="where each process logs (default: <cache>/dsv4/up/<name>)")
    return ap


def prepare(args: argparse.Namespace, env: Mapping[str, str]) -> Cluster:
    """Spec, model, ports, cores -> the cluster to start (raises SpecError naming the field)."""
    dep = load(args.filename or BUNDLED_SPEC)
    if not dep.spec.prefill.replicas:
        raise lc.LocalError([("spec.prefill.replicas", "0 (paused): there is nothing to run")])
    model = resolve_model(dep)
    ports = lc.choose_ports(dep, args.ports)
    lo = lc.local(dep, model=model, ports=ports, cpus=sorted(os.sched_getaffinity(0)), env=env,
                  claims=cache_dir() / "claims")  # fmt: skip
    log_dir = args.log_dir or cache_dir() / "up" / dep.metadata.name
    log_dir.mkdir(parents=True, exist_ok=True)
    return build(dep, lo, log_dir, env)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    source = str(args.filename or BUNDLED_SPEC)
    try:
        cluster = prepare(args, os.environ)
    except SpecError as exc:
        for fieldname, reason in exc.errors:
            print(f"{source}: {fieldname}: {reason}", file=sys.stderr)
        return EXIT_INVALID
    except OSError as exc:
        print(f"{source}: {exc}", file=sys.stderr)
        return EXIT_INVALID
    lo = cluster.local
    roles = f"{len(lo.role('prefill'))} prefill, {len(lo.role('decode'))} decode, 1 router"
    print(
        f"dsv4 up: {cluster.dep.metadata.name} from {source}: {roles} on {len(lo.cpus)} cores; model {lo.model}"
    )
    previous = {sig: signal.signal(sig, cluster.signals) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return cluster.run()
    finally:
        for sig, handler in previous.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(sig, handler)
