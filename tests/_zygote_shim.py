"""``python tests/_zygote_shim.py ARGS...`` behaves as ``python ARGS...`` started warm: it sends its
arguments, environment, working directory and standard streams to the test session's zygote
(tests/_zygote.py, [Note: warm processes behind a launcher]), which forks that process; the shim
waits for it, hands on SIGTERM, SIGINT and SIGHUP, and exits as it exited. Standard library only,
so starting it costs what starting an interpreter costs."""

import json
import os
import signal
import socket
import struct
import sys


def recv_exact(conn: socket.socket, n: int) -> bytes:
    """``n`` bytes from ``conn``; ConnectionError if it closes first. Also the zygote's (tests/_zygote.py)."""
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the other end closed the connection")
        data += chunk
    return data


def main() -> None:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(os.environ["ZS_TEST_ZYGOTE"])
    request = json.dumps({"argv": sys.argv[1:], "env": dict(os.environ), "cwd": os.getcwd()}).encode()
    sys.stdout.flush()
    sys.stderr.flush()
    streams = []
    for fd in (0, 1, 2):  # a launcher may start its workers with a stream closed
        try:
            os.fstat(fd)
            streams.append(fd)
        except OSError:
            streams.append(os.open(os.devnull, os.O_RDWR))
    socket.send_fds(conn, [struct.pack("!I", len(request))], streams)
    conn.sendall(request)
    (pid,) = struct.unpack("!i", recv_exact(conn, 4))
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, lambda s, _frame: os.kill(pid, s))
    (code,) = struct.unpack("!i", recv_exact(conn, 4))
    if code < 0:  # killed by a signal: so is the shim, as its launcher would see it
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


if __name__ == "__main__":
    try:
        main()
    except ConnectionError as e:
        raise SystemExit(f"the test session's zygote: {e}") from None
