"""The world a dry run plans for: hosts x ranks per host of one device."""

from __future__ import annotations

import dataclasses

from dlrm.planning.devices import DeviceSpec
from dlrm.planning.errors import DryRunError


@dataclasses.dataclass(frozen=True)
class Link:
    """A rank's link: bytes per second per direction, and one message's latency."""

    bytes_per_s: float
    latency_s: float

    def seconds(self, sent_bytes: float, messages: int) -> float:
        return sent_bytes / self.bytes_per_s + messages * self.latency_s


@dataclasses.dataclass(frozen=True)
class World:
    """`hosts` x `ranks_per_host` ranks; `device` as the table gives it (a host's
    figures, for a CPU server: `rank_device` is one rank's share)."""

    hosts: int
    ranks_per_host: int
    device: DeviceSpec

    def __post_init__(self) -> None:
        for flag in ("hosts", "ranks_per_host"):
            if getattr(self, flag) < 1:
                raise DryRunError(f"--{flag}: expected >= 1, got {getattr(self, flag)}")

    @property
    def size(self) -> int:
        return self.hosts * self.ranks_per_host

    @property
    def rank_device(self) -> DeviceSpec:
        return self.device.per_rank(self.ranks_per_host)

    @property
    def intra_host(self) -> Link:
        device = self.rank_device
        return Link(device.intra_host_gbit_s * 1e9 / 8, device.intra_host_latency_us * 1e-6)

    @property
    def inter_host(self) -> Link:
        device = self.rank_device
        return Link(device.inter_host_gbit_s * 1e9 / 8, device.inter_host_latency_us * 1e-6)

    @property
    def collective_overhead_s(self) -> float:
        """What a round of collectives costs beyond its bytes and latencies."""
        return self.device.collective_overhead_us * 1e-6

    def with_hosts(self, hosts: int) -> World:
        return dataclasses.replace(self, hosts=hosts)

    def describe(self) -> str:
        return (
            f"{self.hosts} host(s) x {self.ranks_per_host} rank(s) of {self.device.name} "
            f"({self.size} ranks)"
        )
