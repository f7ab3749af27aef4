"""The receiving side of the Mooncake tests, run as its own process:

    python transfer_peer.py SIZE FILL

registers SIZE bytes filled with the byte FILL on a MooncakeTransport at 127.0.0.1, prints one JSON
line {"session", "ptr"}, then answers commands on stdin, one a line:
    dump PATH   -> writes the whole buffer to PATH, prints "ok"
End of input closes the transport and exits.
"""

from __future__ import annotations

import ctypes
import json
import sys

from dsv4_engine.disagg.mooncake import MooncakeTransport


def main(size: int, fill: int) -> int:
    buf = (ctypes.c_uint8 * size).from_buffer(bytearray([fill]) * size)
    ptr = ctypes.addressof(buf)
    transport = MooncakeTransport("127.0.0.1")
    transport.register([ptr], [size])
    print(json.dumps({"session": transport.session_id, "ptr": ptr}), flush=True)
    for line in sys.stdin:
        cmd, _, arg = line.strip().partition(" ")
        if cmd == "dump":
            with open(arg, "wb") as f:
                f.write(bytes(buf))
            print("ok", flush=True)
    transport.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(int(sys.argv[1]), int(sys.argv[2])))
