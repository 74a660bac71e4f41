"""A throwaway redis-server for the tier tests: 127.0.0.1 on a free port, no persistence, a memory cap
with allkeys-lru; started and stopped by the tests (Debian's redis-server, installed by `make sysdeps`)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def require_redis_server() -> str:
    """The redis-server binary; in CI its absence fails the test instead of skipping it."""
    path = shutil.which("redis-server")
    if path is None:
        message = "redis-server is not installed (make sysdeps installs Debian's redis-server)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    pytest.importorskip("redis") if not os.environ.get("CI") else __import__("redis")
    return path


class RedisServer:
    def __init__(self, maxmemory: str = "64mb"):
        self.binary = require_redis_server()
        self.port = _free_port()
        self.maxmemory = maxmemory
        self.proc: subprocess.Popen | None = None
        self.paused = False

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "RedisServer":
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--maxmemory", self.maxmemory, "--maxmemory-policy", "allkeys-lru", "--protected-mode", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import redis
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=1, socket_connect_timeout=1)
        deadline = time.monotonic() + 10
        while True:
            try:
                if client.ping():
                    break
            except redis.RedisError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server on port {self.port} did not answer PING")
                time.sleep(0.02)
        client.close()
        return self

    def client(self):
        import redis
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2, socket_connect_timeout=2)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            if self.paused:
                self.resume()
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    def pause(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        if self.paused and self.proc is not None:
            os.kill(self.proc.pid, signal.SIGCONT)
        self.paused = False

    def restart(self) -> None:
        """A new, empty server on the same port."""
        self.kill()
        self.start()

    def stop(self) -> None:
        self.resume()
        self.kill()
