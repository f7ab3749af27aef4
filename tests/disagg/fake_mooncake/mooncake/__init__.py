"""A stand-in for Mooncake's Python package, for starting a server on a transport this machine has no
hardware for (tests/disagg/test_pd_transport_args.py): it records what the server asks of it."""
