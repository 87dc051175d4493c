"""A TCP port for a coordinator the test starts, held so nothing else can take it meanwhile.

Asking the OS for a free port and closing the socket before the coordinator binds it is a race:
another process may take the port in between. :func:`held_port` keeps the socket bound (not
listening) with ``SO_REUSEPORT`` until the processes have exited; JAX's coordinator (a gRPC
server, which sets ``SO_REUSEPORT`` too) binds the same port beside it, while any other
program's bind fails. Connections go to the listening socket only.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator


def _bound(port: int) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        s.bind(("127.0.0.1", port))
    except OSError:
        s.close()
        raise
    return s


@contextlib.contextmanager
def held_port(port: int = 0) -> Iterator[int]:
    """Binds ``port`` (0: one the OS chooses) and yields its number; released on exit.

    Raises:
      OSError: ``port`` is in use by a socket without ``SO_REUSEPORT``.
    """
    with _bound(port) as s:
        yield s.getsockname()[1]
