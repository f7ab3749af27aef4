"""Engine subcommands of `dsv4`; each imports its module only when it runs."""

from __future__ import annotations

import os

DEMO_HELP = (
    "the tiny architecture trained on Python's help topics, then its MTP layer "
    "(about 15 minutes on 2 cores; the bundled one is dsv4_engine/data/demo)"
)


# How long torch's idle OpenMP workers spin before they sleep. libgomp's default, 300,000 spins, kept
# a second core busy through every CPU decode step for no speed (demo model, batch 8: 2.0 cores for
# the step time 1.0 core gives); 3,000 still hands back-to-back ops of a prefill to a spinning worker
# (a 410-token chunk: 50 ms against 47). libgomp reads it once, as torch loads it.
SPIN_COUNT = "3000"


def serve_main(argv: list[str]) -> int:
    if "OMP_WAIT_POLICY" not in os.environ:  # an operator's own choice stands
        os.environ.setdefault("GOMP_SPINCOUNT", SPIN_COUNT)
    from dsv4_engine.server.main import main

    return main(argv)


def make_tiny_main(argv: list[str]) -> int:
    # `--preset demo` is dispatched here, above both: demo builds on make_tiny, so make_tiny
    # dispatching to demo made the two modules import each other.
    from dsv4_engine import demo_train, make_tiny, mtp_train

    p = make_tiny.parser({"demo": DEMO_HELP})
    demo_train.add_arguments(p)
    a = p.parse_args(argv)
    if a.preset != "demo":
        return make_tiny.run(a)
    if a.quant != "none" or a.shards != 1:
        p.error("--preset demo writes one bf16 file: --quant and --shards do not apply")
    if a.mtp:
        p.error("--preset demo trains its MTP layer: --mtp-steps sets its steps (0: none)")
    if not a.mtp_only:
        demo_train.train(a.out, steps=a.steps, seed=a.seed, threads=a.threads)
    if a.mtp_steps:  # the second stage reads the first's checkpoint back: --mtp-only gives the same bytes
        mtp_train.train_mtp(a.out, steps=a.mtp_steps, seed=a.seed, threads=a.threads)
    return 0
