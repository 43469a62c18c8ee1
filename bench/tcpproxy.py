"""A TCP forwarder on loopback whose link can be cut and restored: a database outage as the
service sees it (connections dropped, new ones refused) without touching the shared server.

Shared by the tests (through `tests/tcpproxy.py`) and the bench's soak (`bench/soak.py`)."""

from __future__ import annotations

import contextlib
import socket
import threading


class Proxy:
    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._server.getsockname()[1]
        self._cut = threading.Event()
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._open: list[socket.socket] = []
        self._accepter = threading.Thread(target=self._accept, daemon=True, name="proxy")
        self._accepter.start()

    def cut(self) -> None:
        """Drop every connection; refuse new ones until `restore()`."""
        self._cut.set()
        with self._lock:
            socks, self._open = self._open, []
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def restore(self) -> None:
        self._cut.clear()

    def close(self) -> None:
        self._closed.set()
        self.cut()
        self._server.close()
        self._accepter.join(timeout=5)

    def _accept(self) -> None:
        self._server.settimeout(0.2)
        while not self._closed.is_set():
            try:
                client, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if self._cut.is_set():
                client.close()  # the database is "down": the connection ends at once
                continue
            try:
                up = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                client.close()
                continue
            client.settimeout(None)
            up.settimeout(None)  # a database connection may idle for minutes
            with self._lock:
                self._open += [client, up]
            for a, b in ((client, up), (up, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
