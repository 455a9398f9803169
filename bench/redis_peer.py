"""The Redis side of `kvtier bench --compare redis`.

Starts Debian's `redis-server` on a free loopback port (persistence off, as a
cache would run it) and drives it through redis-py with hiredis, exposing the
same method names the benchmark calls on a kvtier `Client`: single puts and
gets are SET/GET, batches are MSET/MGET. Redis has no receive-into-buffer
call, so the `*_into` workloads are skipped for it.
"""

from __future__ import annotations

import shutil
import socket

from kvtier.common.supervisor import Supervisor


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisPeer:
    supports_into = False

    def __init__(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (Debian: apt-get install redis-server)")
        try:
            import redis
        except ImportError:
            raise RuntimeError("redis-py is not installed (pip install 'redis[hiredis]')") from None
        self.port = free_port()
        self._redis = redis.Redis(host="127.0.0.1", port=self.port)

        def answers() -> bool:
            try:
                return bool(self._redis.ping())
            except redis.ConnectionError:
                return False

        self._supervisor = Supervisor()
        try:
            self._supervisor.start(
                "redis-server",
                [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                 "--maxmemory", "0", "--loglevel", "warning"],
                log=None,
                quiet=True,
                probe=answers,
                timeout=10.0,
                poll_s=0.05,
            )  # fmt: skip
        except RuntimeError:
            self.close()
            raise RuntimeError("redis-server did not start") from None
        info = self._redis.info("server")
        self.version = info.get("redis_version", "?")
        try:
            import hiredis  # noqa: F401

            self.parser = "hiredis"
        except ImportError:
            self.parser = "python"

    @staticmethod
    def prepare(values: list[memoryview]) -> list[bytes]:
        return [bytes(v) for v in values]  # redis-py encodes bytes, not memoryviews; done before timing

    def put(self, key: str, value: bytes) -> None:
        self._redis.set(key, value)

    def get(self, key: str) -> bytes | None:
        return self._redis.get(key)

    def batch_put(self, keys: list[str], values: list[bytes]) -> list[int]:
        self._redis.mset(dict(zip(keys, values, strict=True)))
        return [0] * len(keys)

    def batch_get(self, keys: list[str]) -> list[bytes | None]:
        return self._redis.mget(keys)

    def remove(self, key: str) -> None:
        self._redis.delete(key)

    def batch_remove(self, keys: list[str]) -> None:
        self._redis.delete(*keys)

    def remove_prefix(self, prefix: str) -> None:
        for key in self._redis.scan_iter(match=f"{prefix}*", count=1000):
            self._redis.delete(key)

    def close(self) -> None:
        self._redis.close()
        self._supervisor.close()  # SIGTERM; SIGKILL after 10 s
