"""Print the port `make lab` / `make dashboard` will serve on, so the URL they print is the real one.

    python scripts/free_port.py PORT VAR ORIGIN

VAR is the make variable that holds the port (LAB_PORT, DASHBOARD_PORT); ORIGIN is make's `$(origin VAR)`: a port the user chose ("command line", "environment") must be
free or we stop with a message saying what to do; the default port moves to the next free one
(the server is then started with port_retries=0, so it can never move again on its own).
"""
from __future__ import annotations

import socket
import sys


def is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def main(argv: list[str]) -> int:
    port, var, origin = int(argv[1]), argv[2], " ".join(argv[3:])
    if is_free(port):
        print(port)
        return 0
    if origin in ("command line", "environment", "environment override"):
        print(f"port {port} on 127.0.0.1 is busy; choose another, e.g. {var}={port + 1}, or leave {var} "
              "unset to take the next free one", file=sys.stderr)
        return 1
    for p in range(port + 1, port + 200):
        if is_free(p):
            print(p)
            return 0
    print(f"no free port in {port}..{port + 199} on 127.0.0.1; give one with {var}=", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
