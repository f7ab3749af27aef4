"""Engine subcommands of `dsv4`; each imports its module only when it runs."""

from __future__ import annotations


def serve_main(argv: list[str]) -> int:
    from dsv4_engine.server.main import main

    return main(argv)


def make_tiny_main(argv: list[str]) -> int:
    from dsv4_engine.make_tiny import main

    return main(argv)
