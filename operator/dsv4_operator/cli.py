"""The `dsv4` console script.

Each subcommand lives in its own module and is imported only when it runs, so `dsv4 render` and
`dsv4 operator` never import torch (the operator image carries none).
"""

from __future__ import annotations

import importlib
import sys

# name -> (module, function, one-line help). The function takes the remaining argv.
COMMANDS: dict[str, tuple[str, str, str]] = {
    "up": ("dsv4_operator.up", "main", "run a Dsv4Deployment as local processes (a PD cluster on 127.0.0.1)"),
    "render": ("dsv4_operator.render", "main", "print the Kubernetes objects that realise a Dsv4Deployment"),
    "operator": ("dsv4_operator.run", "main", "run the operator (kopf) against the current cluster"),
    "serve": ("dsv4_engine.cli", "serve_main", "serve one model with the OpenAI-compatible API"),
    "make-tiny": (
        "dsv4_engine.cli",
        "make_tiny_main",
        "write a random tiny DSV4 checkpoint with a tokenizer",
    ),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: dsv4 COMMAND [ARGS...] | dsv4 --version", "", "commands:"]
    lines += [f"  {name.ljust(width)}  {help_}" for name, (_, _, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if argv[0] == "--version":
        from dsv4_engine import package_version  # the package's __init__ only: no torch

        print(f"dsv4 {package_version()}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"dsv4: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module, func, _ = COMMANDS[name]
    return int(getattr(importlib.import_module(module), func)(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
