"""A TCP forwarder between a gateway and its broker whose connections a test cuts at an
exact moment (by the bytes sent), for the tests of lost connections."""

import socket
import threading
from typing import List, Optional, Tuple
from urllib.parse import urlsplit


class Proxy:
    """The gateway's way to the broker: a TCP forwarder whose connections the test cuts at
    once (rabbitmqctl close_connection takes a second to start: too late for the worst
    moment). New connections keep being accepted."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.target = (parts.hostname, parts.port or 5672)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.url = url.replace(f":{self.target[1]}/", f":{self.port}/")
        self.pairs: List[socket.socket] = []
        self.accepted = 0
        self.trip: Optional[Tuple[int, int]] = None  # (connection number from 1, bytes it sends): then cut
        self.holding = False  # what clients send is dropped, not forwarded (`hold`)
        self.dropped = 0  # bytes dropped while holding
        self.hold_on: Optional[Tuple[bytes, int]] = None  # (bytes, occurrence): then hold (`hold_at`)
        self._tail = b""
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def cut_at(self, connection: int, sent_bytes: int) -> None:
        """Cut every connection once connection number `connection` (1 = the first accepted)
        has sent `sent_bytes` towards the broker: the same moment on a busy machine too."""
        self.trip = (connection, sent_bytes)

    def hold(self) -> None:
        """From now on, what clients send never reaches the broker (counted in `dropped`):
        a process then stopped (SIGKILL) never had its last words heard, whatever they were."""
        self.holding = True

    def hold_at(self, pattern: bytes, occurrence: int = 1) -> None:
        """`hold` once clients send `pattern` for the occurrence-th time, from the piece that
        holds it (a frame of a publish to one exchange, say: it never reaches the broker)."""
        self.hold_on = (pattern, occurrence)

    def _watch(self, data: bytes) -> None:
        if self.hold_on is None:
            return
        pattern, left = self.hold_on
        seen = (self._tail + data).count(pattern) - self._tail.count(pattern)
        self._tail = (self._tail + data)[-len(pattern):]
        if seen >= left:
            self.hold_on, self.holding = None, True
        elif seen:
            self.hold_on = (pattern, left - seen)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            with self.lock:
                self.pairs += [client, server]
                self.accepted += 1
                number = self.accepted
            threading.Thread(target=self._pipe, args=(client, server, number), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, 0), daemon=True).start()

    def _pipe(self, a: socket.socket, b: socket.socket, number: int) -> None:
        sent = 0
        try:
            while True:
                data = a.recv(65536)
                if not data:
                    break
                if number:
                    self._watch(data)
                if number and self.holding:
                    self.dropped += len(data)
                    continue
                if number and self.trip and self.trip[0] == number and sent + len(data) >= self.trip[1]:
                    b.sendall(data[:max(0, self.trip[1] - sent)])
                    self.trip = None
                    self.cut()
                    break
                b.sendall(data)
                sent += len(data)
        except OSError:
            pass
        for s in (a, b):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def cut(self) -> int:
        with self.lock:
            pairs, self.pairs = self.pairs, []
        for s in pairs:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        return len(pairs) // 2

    def close(self) -> None:
        self.listener.close()
        self.cut()
