"""Loopback addresses for the local node's pods (one per pod, so engines can share a port)."""

from __future__ import annotations

__all__ = ["IpPool"]


class IpPool:
    """Loopback addresses {prefix}.{first}..{prefix}.254; Linux routes all of 127/8 to `lo`."""

    def __init__(self, prefix: str = "127.0.0", first: int = 10, last: int = 254) -> None:
        self._free = [f"{prefix}.{n}" for n in range(first, last + 1)]
        self._used: set[str] = set()

    def allocate(self) -> str:
        if not self._free:
            raise RuntimeError("no free loopback address left for pods")
        ip = self._free.pop(0)
        self._used.add(ip)
        return ip

    def release(self, ip: str) -> None:
        if ip in self._used:
            self._used.remove(ip)
            # Lowest first, so addresses are reused predictably (127.0.0.10 for the first pod).
            self._free.append(ip)
            self._free.sort(key=lambda a: int(a.rsplit(".", 1)[1]))
