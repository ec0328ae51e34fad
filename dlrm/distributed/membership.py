"""A worker's side of Horovod Elastic: joining the world the driver forms, the
driver's notices of hosts added or removed, and telling a lost rank from other
failures."""

from __future__ import annotations

import re
import socket

import tensorflow as tf

from dlrm.distributed.collectives import HorovodCollectives, set_horovod_defaults


class HostsChanged(Exception):
    """Horovod Elastic's driver listed hosts that were added or removed, and every
    rank saw it at the same step (`ElasticMembership.check_host_updates`)."""


def lost_a_rank(error: BaseException) -> bool:
    """Whether `error` is a collective that failed because a rank was lost (its
    process or its host gone, its link down): Horovod shut down under it, or the
    op in flight failed in Gloo's transport. The survivors can continue after
    `ElasticMembership.reset`."""
    from horovod.common.exceptions import HorovodInternalError

    if isinstance(error, HorovodInternalError):
        return True
    if not isinstance(error, tf.errors.OpError):
        return False
    message = str(error.message)
    return "Horovod has been shut down" in message or "gloo/transport" in message


# Gloo's transport errors name the peer: "Read error [10.0.0.3]:45232: ...".
_PEER_ADDRESS = re.compile(r"\[(\d{1,3}(?:\.\d{1,3}){3})\]:\d+")


def lost_peer(error: BaseException) -> str | None:
    """The peer a failed collective names, as "host at address" when the address
    resolves, else the address; None when the error names none."""
    match = _PEER_ADDRESS.search(str(error))
    if match is None:
        return None
    address = match.group(1)
    try:
        return f"{socket.gethostbyaddr(address)[0]} at {address}"
    except OSError:
        return address


class ElasticMembership:
    """This worker's side of Horovod Elastic (`horovodrun --host-discovery-script`):
    `hvd.init()` with the world the driver formed, the driver's notices of hosts
    added or removed, and `reset` to form the next world after a rank was lost or
    hosts changed. It keeps no training state: the checkpoints are that state
    (`dlrm.elastic`)."""

    def __init__(self) -> None:
        import horovod.tensorflow as hvd
        from horovod.common.elastic import State, notification_manager

        class HostNotices(State):
            """Only the notices; Horovod's save/restore/sync of in-memory state
            are not used (a reset restores a checkpoint)."""

            def save(self) -> None:
                pass

            def restore(self) -> None:
                pass

            def sync(self) -> None:
                pass

        self._hvd = hvd
        self._notifications = notification_manager
        set_horovod_defaults()
        hvd.init()
        self._notices = HostNotices(bcast_object=hvd.broadcast_object, get_rank=hvd.rank)
        notification_manager.init()
        notification_manager.register_listener(self._notices)

    def collectives(self, bind_cpus: bool = True) -> HorovodCollectives:
        """The collectives of the current world."""
        return HorovodCollectives(bind_cpus, initialize=False)

    def check_host_updates(self) -> None:
        """Raises `HostsChanged` on every rank alike when the driver announced
        hosts added or removed since the last call (one broadcast from rank 0)."""
        from horovod.common.exceptions import HostsUpdatedInterrupt

        try:
            self._notices.check_host_updates()
        except HostsUpdatedInterrupt as interrupt:
            raise HostsChanged("the elastic driver changed the hosts") from interrupt

    def reset(self) -> None:
        """Leaves the current world and joins the next one the driver forms (blocks
        until it has, bounded by horovodrun's --elastic-timeout)."""
        self._hvd.shutdown()
        self._hvd.init()
        self._notices.on_reset()

    def close(self) -> None:
        self._notifications.remove_listener(self._notices)
