"""Where the processes of a run listen, and keeping a local run on loopback.

A local run promises that nothing it starts accepts a connection from another machine: Ray's
processes (GCS, raylet, agents, workers), the driver's rendezvous store, gloo's sockets. This
module lists what a tree of processes listens on (psutil, by PID) so that promise is checked,
not assumed, and holds the small helpers that keep it: a listening socket bound to one address
(the rendezvous store's), and the network interface that carries an address (gloo's).
"""

from __future__ import annotations

import ipaddress
import socket
import threading
from collections.abc import Iterable
from dataclasses import dataclass

import psutil


@dataclass(frozen=True)
class Listener:
    """One listening TCP socket of one process."""

    pid: int
    process: str
    ip: str
    port: int

    def __str__(self) -> str:
        return f"{self.process} (pid {self.pid}) on {self.ip}:{self.port}"


def is_loopback(ip: str) -> bool:
    """127.0.0.0/8, ::1, or 127.x mapped into IPv6 (a dual-stack socket bound to 127.0.0.1)."""
    addr = ipaddress.ip_address(ip.split("%", 1)[0])
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback


def process_tree(root: int | None = None) -> list[psutil.Process]:
    """`root` (default this process) and every process below it. A local Ray cluster's GCS,
    raylet and agents are children of the driver that started it, its workers the raylet's."""
    top = psutil.Process(root)
    try:
        return [top, *top.children(recursive=True)]
    except psutil.NoSuchProcess:
        return [top]


def listeners(processes: Iterable[psutil.Process]) -> list[Listener]:
    """Every listening TCP socket of `processes` (a process that exits meanwhile is skipped)."""
    found: list[Listener] = []
    for proc in processes:
        try:
            name = proc.name()
            conns = proc.net_connections(kind="inet")
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
        for c in conns:
            if c.status == psutil.CONN_LISTEN and c.laddr:
                found.append(Listener(proc.pid, name, c.laddr.ip, c.laddr.port))
    return found


def wide_listeners(processes: Iterable[psutil.Process]) -> list[Listener]:
    """The listening sockets of `processes` that another machine could reach."""
    return [x for x in listeners(processes) if not is_loopback(x.ip)]


def listen_socket(host: str) -> socket.socket:
    """A TCP socket listening on `host` only, on a free port (a server handed it listens no
    wider than the address its clients need)."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.bind(addr)
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


def interface_of(ip: str) -> str | None:
    """The name of the network interface that carries `ip` (e.g. "lo" for 127.0.0.1 on
    Linux), or None if no interface of this machine does."""
    want = ipaddress.ip_address(ip)
    for name, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            if a.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            try:
                if ipaddress.ip_address(a.address.split("%", 1)[0]) == want:
                    return name
            except ValueError:
                continue
    return None


class ListenWatch:
    """Samples what a process tree listens on, in a thread, while a block runs: every
    listening socket seen, and those that were not loopback (a run checked while it trains,
    not only before or after)."""

    def __init__(self, root: int | None = None, every_s: float = 0.5) -> None:
        self.root = root
        self.every_s = every_s
        self.samples = 0
        self.seen: set[Listener] = set()
        self.processes: set[str] = set()  # names of the processes seen listening
        self._lock = threading.Lock()  # the thread and a caller's `sample()` may overlap
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="listen-watch", daemon=True)

    @property
    def wide(self) -> list[Listener]:
        return sorted((x for x in self.seen if not is_loopback(x.ip)), key=str)

    def sample(self) -> None:
        try:
            found = listeners(process_tree(self.root))
        except psutil.NoSuchProcess:  # the root itself is gone
            return
        with self._lock:
            self.seen.update(found)
            self.processes.update(x.process for x in found)
            self.samples += 1

    def _loop(self) -> None:
        while True:
            self.sample()
            if self._stop.wait(self.every_s):
                return

    def __enter__(self) -> ListenWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()  # and once more, at the end
