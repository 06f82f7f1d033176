"""A fake monitor run as another user: answers any HELLO with a HELLO_OK that would point
the client's stack dumps at a file of the impostor's choosing.

    setpriv --reuid=65534 ... python tests/workers/impostor.py SOCKET_PATH

Prints "listening" once the socket accepts connections.
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ft_client import wire  # noqa: E402


def main() -> None:
    path = sys.argv[1]
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(8)
    print("listening", flush=True)
    while True:
        conn, _ = srv.accept()
        try:
            conn.recv(65536)
            conn.sendall(wire.encode(wire.HelloOk(wire.PROTOCOL_VERSION, {
                "rank": 0, "pid": 1, "session": 1,
                "timeouts": {"rank_section_timeouts": {}},
                "stack_dump_signal": 12, "stack_dump_path": "/tmp/impostor-chosen-file",
                "on_monitor_lost": "raise",
            })))
        finally:
            conn.close()


if __name__ == "__main__":
    main()
