"""A TCP proxy in front of a real server that can stall connections, for timeout tests.

A stalled connection forwards the client's bytes to the server (the request arrives) but never
forwards the answer back: the client sees a connection that is open and silent, the fault a hung
load balancer or a stuck gateway produces. Connections that are not stalled are forwarded both
ways unchanged.

Usage::

    with StallProxy(upstream_port) as proxy:
        proxy.stall_next(1)           # the next new connection is stalled
        ... endpoint f"http://127.0.0.1:{proxy.port}" ...
        assert proxy.stalled == 1
"""

from __future__ import annotations

import socket
import threading
from typing import Any

__all__ = ["StallProxy"]


class StallProxy:
    def __init__(self, upstream_port: int, host: str = "127.0.0.1") -> None:
        self._upstream = (host, upstream_port)
        self._listener = socket.create_server((host, 0))
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._to_stall = 0
        self.stalled = 0  # connections stalled so far
        self.forwarded = 0  # connections forwarded so far
        self._socks: list[socket.socket] = []
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def stall_next(self, n: int) -> None:
        """Stalls the next ``n`` new connections."""
        with self._lock:
            self._to_stall = n

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                stall = self._to_stall > 0
                if stall:
                    self._to_stall -= 1
                    self.stalled += 1
                else:
                    self.forwarded += 1
                self._socks.append(client)
            try:
                server = socket.create_connection(self._upstream)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._socks.append(server)
            threading.Thread(target=self._pump, args=(client, server), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, stall),
                             daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, drop: bool = False) -> None:
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                if not drop:  # a stalled connection's answer is read and thrown away
                    dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._closed.set()
        self._listener.close()
        with self._lock:
            socks, self._socks = self._socks, []
        for s in socks:
            s.close()
        self._thread.join(5)

    def __enter__(self) -> StallProxy:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
