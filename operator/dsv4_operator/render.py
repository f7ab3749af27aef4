"""`dsv4 render`: print the Kubernetes objects a Dsv4Deployment becomes, or the CRD itself.

    dsv4 render -f examples/minimal.yaml            # every child object, multi-document YAML
    dsv4 render -f dep.yaml --fingerprint           # just the deployment fingerprint(s)
    dsv4 render --crd                               # the CRD (Kubernetes 1.25+, CEL rules)
    dsv4 render --crd --no-cel                      # the CRD for Kubernetes < 1.25
    dsv4 render -f dep.yaml --kube-version 1.20     # objects for an old API server

A spec that fails validation prints one line per problem, `FILE: FIELD: REASON`, on stderr and exits 2.
The output is deterministic: the same input gives byte-identical YAML.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

import yaml

from dsv4_operator.spec import SpecError

EXIT_INVALID = 2


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (ConfigMap files) as literal blocks, so they read as files."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def dump(objs: list[dict[str, Any]]) -> str:
    return yaml.dump_all(
        objs, Dumper=_Dumper, sort_keys=True, default_flow_style=False, explicit_start=True, width=100
    )


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="dsv4 render", description=__doc__.split("\n\n")[0])
    ap.add_argument("-f", "--filename", action="append", default=[], help="Dsv4Deployment YAML ('-' = stdin)")
    ap.add_argument(
        "-n", "--namespace", help="namespace of the children (default: the resource's, else default)"
    )
    ap.add_argument(
        "--serving-fingerprint", help="generation the endpoint Service routes to (default: current)"
    )
    ap.add_argument(
        "--kube-version",
        metavar="MAJOR.MINOR",
        help="target Kubernetes version (< 1.21: PodDisruptionBudgets as policy/v1beta1)",
    )
    ap.add_argument("--fingerprint", action="store_true", help="print only the deployment fingerprint")
    ap.add_argument("--crd", action="store_true", help="print the Dsv4Deployment CRD")
    ap.add_argument("--no-cel", action="store_true", help="with --crd: drop CEL rules (Kubernetes < 1.25)")
    return ap


def _load(path: str) -> list[Any]:
    text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    return [d for d in yaml.safe_load_all(text) if d is not None]


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.crd:
        from dsv4_operator.crd import crd_yaml

        sys.stdout.write(crd_yaml(cel=not args.no_cel))
        return 0
    if not args.filename:
        _parser().print_usage(sys.stderr)
        print("dsv4 render: give -f FILE (or --crd)", file=sys.stderr)
        return EXIT_INVALID

    from dsv4_operator.fingerprint import deployment_fingerprint
    from dsv4_operator.manifests import render
    from dsv4_operator.spec import parse

    kube_minor = None
    if args.kube_version:
        match = re.fullmatch(r"v?1\.(\d+)(\.\d+)?", args.kube_version)
        if not match:
            print(f"dsv4 render: --kube-version {args.kube_version!r}: expected e.g. 1.30", file=sys.stderr)
            return EXIT_INVALID
        kube_minor = int(match.group(1))
    out: list[str] = []
    failed = False
    for path in args.filename:
        try:
            docs = _load(path)
        except (OSError, yaml.YAMLError) as exc:
            print(f"{path}: {exc}", file=sys.stderr)
            failed = True
            continue
        if not docs:
            print(f"{path}: no Dsv4Deployment in the file", file=sys.stderr)
            failed = True
        for doc in docs:
            try:
                dep = parse(doc)
            except SpecError as exc:
                for field, reason in exc.errors:
                    print(f"{path}: {field}: {reason}", file=sys.stderr)
                failed = True
                continue
            if args.fingerprint:
                out.append(f"{dep.metadata.name} {deployment_fingerprint(dep)}\n")
            else:
                objs = render(
                    dep,
                    serving_fingerprint=args.serving_fingerprint,
                    namespace=args.namespace,
                    kube_minor=kube_minor,
                )
                out.append(dump(objs))
    if failed:
        return EXIT_INVALID
    sys.stdout.write("".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
