"""Collectives between ranks: the one module that imports Horovod (its elastic
mode's side of a worker included: `ElasticMembership`).

Everything else takes a `Collectives` value (rank, world size and the few
operations training needs), so the same model and trainer run on one process
(`Collectives`, no Horovod import at all) or under `horovodrun`
(`HorovodCollectives`: Gloo on CPU, NCCL/MPI on GPU clusters, as Horovod was built).

Collectives inside a `tf.function` take a `name`: Horovod pairs the ranks'
operations by name, and ranks that hold different shards build different
graphs, so names derived from the graph would not match and the job would hang.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import tensorflow as tf

from dlrm.launch import launched_by_horovod


class Collectives:
    """One process: every collective is the identity."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    # TensorFlow's intra-op threads this process was given (`share_cpus`), or None.
    intra_op_threads: int | None = None
    # The CPUs this process was bound to (`share_cpus`), or None: not bound.
    bound_cpus: tuple[int, ...] | None = None

    def alltoall(
        self, tensor: tf.Tensor, splits: Sequence[int] | tf.Tensor, name: str
    ) -> tf.Tensor:
        """Sends rows [sum(splits[:j]), sum(splits[:j+1])) of `tensor` to rank j;
        returns what every rank sent here, concatenated in rank order."""
        return tensor

    def allreduce_sum(self, tensors: Sequence[tf.Tensor], names: Sequence[str]) -> list[tf.Tensor]:
        """Element-wise sums over ranks, one name per tensor."""
        return list(tensors)

    def allgather(self, tensor: tf.Tensor, name: str) -> tf.Tensor:
        """Every rank's `tensor` concatenated along axis 0, in rank order."""
        return tensor

    def allgather_object(self, value: Any, name: str) -> list[Any]:
        """Every rank's picklable `value`, in rank order. Named: Horovod would
        otherwise name it after the value's type, which may differ by rank."""
        return [value]

    def broadcast_variables(self, variables: Sequence[Any]) -> None:
        """Rank 0's values into every rank's `variables`."""

    def barrier(self) -> None:
        """Returns once every rank has called it."""


# A rank that stops submitting collectives (stuck, not dead) makes Horovod warn after
# the check time and shut every rank down after the shutdown time, instead of the
# others waiting forever. Horovod leaves the shutdown off by default. A rank that
# dies is handled sooner: its peers' Gloo/MPI connections fail and horovodrun (or
# srun/mpirun) ends the job. The environment overrides both.
STALL_DEFAULTS = {
    "HOROVOD_STALL_CHECK_TIME_SECONDS": "60",
    "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "900",
}

# Without GPUs: Horovod's background thread coordinates the ranks' pending
# collectives every cycle; every 3 ms instead of Horovod's default (1 ms) left
# more of the CPUs to the ranks' compute. 2 ranks on 2 cores, batch 8192, fp32,
# 4 alternating runs: 853-876 ms a step against 884-914 ms. A CPU step takes
# hundreds of ms, so 2 ms more latency per collective round is noise; on GPUs,
# whose steps take milliseconds, Horovod's default stays. The environment overrides it.
CPU_DEFAULTS = {"HOROVOD_CYCLE_TIME": "3"}


class HorovodCollectives(Collectives):
    """Horovod's collectives; `hvd.init()` runs on construction.

    Args:
        bind_cpus: bind each rank on a host to its own CPUs (`share_cpus`).
        initialize: run `hvd.init()`; False when it has run (`ElasticMembership`).
    """

    def __init__(self, bind_cpus: bool = True, initialize: bool = True) -> None:
        import horovod.tensorflow as hvd

        self._hvd = hvd
        if initialize:
            set_horovod_defaults()
            hvd.init()
        self.rank = hvd.rank()
        self.world_size = hvd.size()
        self.local_rank = hvd.local_rank()
        pin_gpu(self.local_rank)
        self.bound_cpus, self.intra_op_threads = share_cpus(
            hvd.local_size(), hvd.local_rank(), bind_cpus
        )

    def alltoall(
        self, tensor: tf.Tensor, splits: Sequence[int] | tf.Tensor, name: str
    ) -> tf.Tensor:
        result = self._hvd.alltoall(tensor, splits=tf.cast(splits, tf.int32), name=name)
        # Horovod returns (tensor, received_splits) in 0.28.
        return result[0] if isinstance(result, (tuple, list)) else result

    def allreduce_sum(self, tensors: Sequence[tf.Tensor], names: Sequence[str]) -> list[tf.Tensor]:
        def reduce(flat: tf.Tensor, name: str) -> tf.Tensor:
            return self._hvd.allreduce(flat, op=self._hvd.Sum, name=name)

        return packed(tensors, names, reduce)

    def allgather(self, tensor: tf.Tensor, name: str) -> tf.Tensor:
        return self._hvd.allgather(tensor, name=name)

    def allgather_object(self, value: Any, name: str) -> list[Any]:
        return list(self._hvd.allgather_object(value, name=name))

    def broadcast_variables(self, variables: Sequence[Any]) -> None:
        resources = [getattr(v, "value", v) for v in variables]
        self._hvd.broadcast_variables(resources, root_rank=0)

    def barrier(self) -> None:
        self._hvd.allreduce(tf.constant(0.0), op=self._hvd.Sum, name="barrier").numpy()


def packed(
    tensors: Sequence[tf.Tensor],
    names: Sequence[str],
    reduce: Callable[[tf.Tensor, str], tf.Tensor],
) -> list[tf.Tensor]:
    """`reduce` applied to `tensors` laid end to end in one flat buffer per dtype
    (named after its first tensor), the results cut back into their shapes.

    So that a run repeats bit for bit on any number of ranks: Horovod fuses the
    allreduces that happen to be ready in the same cycle into one buffer, and a
    ring allreduce (Gloo's, NCCL's, MPI's) adds up each segment of a buffer
    starting at another rank. From 3 ranks on, (a + b) + c and (b + c) + a round
    differently, so where a tensor landed in the fused buffer changed its sums
    from run to run (3 ranks, 20 steps: 3e-8 apart; 300 steps: 3e-4, once a ReLU
    input within rounding of zero switched sides). One buffer per call puts every
    element at the same place each time; the caller keeps two calls of a step
    from being in flight together (`Trainer`)."""
    results: list[tf.Tensor | None] = [None] * len(tensors)
    by_dtype: dict[tf.DType, list[int]] = {}
    for index, tensor in enumerate(tensors):
        by_dtype.setdefault(tensor.dtype, []).append(index)
    for members in by_dtype.values():
        name = names[members[0]]
        if len(members) == 1:
            results[members[0]] = reduce(tensors[members[0]], name)
            continue
        flat = tf.concat([tf.reshape(tensors[i], [-1]) for i in members], axis=0)
        sizes = [tf.size(tensors[i]) for i in members]
        pieces = tf.split(reduce(flat, name), tf.stack(sizes), num=len(members))
        for i, piece in zip(members, pieces, strict=True):
            results[i] = tf.reshape(piece, tf.shape(tensors[i]))
    return [r for r in results if r is not None]


def set_horovod_defaults() -> None:
    """`STALL_DEFAULTS` (and `CPU_DEFAULTS` without GPUs) where the environment
    does not set them; read by `hvd.init()`."""
    defaults = dict(STALL_DEFAULTS)
    if not tf.config.list_physical_devices("GPU"):
        defaults.update(CPU_DEFAULTS)
    for name, value in defaults.items():
        os.environ.setdefault(name, value)


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


class RankMismatchError(RuntimeError):
    """Ranks hold different plans, tables or settings, or one rank failed a step
    that every rank must finish (a checkpoint write, a restore)."""

    # Found from one allgather, the same on every rank (dlrm.launch.same_on_every_rank).
    same_on_every_rank = True


def check_ranks_agree(collectives: Collectives, facts: Mapping[str, Any]) -> None:
    """One allgather of every rank's `facts` (the plan, table shapes, model and
    optimizer settings); raises `RankMismatchError` on every rank, naming the
    first rank that differs from rank 0 and where, before anything is assembled
    from mismatched pieces."""
    everyone = collectives.allgather_object(dict(facts), name="check_ranks_agree")
    reference = everyone[0]
    for rank, theirs in enumerate(everyone[1:], start=1):
        difference = first_difference(reference, theirs)
        if difference is not None:
            path, ours, other = difference
            raise RankMismatchError(
                f"the ranks disagree before training: rank {rank} differs from rank 0 in "
                f"{path} (rank 0: {_short(ours)}, rank {rank}: {_short(other)}). Every rank "
                f"must see the same FeatureSpec, --sharding_plan file and model, optimizer "
                f"and batch flags"
            )


def first_difference(a: Any, b: Any, path: str = "") -> tuple[str, Any, Any] | None:
    """(key path, a's value, b's value) of the first place where `a` and `b`
    differ, or None. Dicts compare key by key, lists item by item."""
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        for key in sorted(set(a) | set(b), key=str):
            where = f"{path}.{key}" if path else str(key)
            if key not in a or key not in b:
                return where, a.get(key, "<missing>"), b.get(key, "<missing>")
            found = first_difference(a[key], b[key], where)
            if found is not None:
                return found
        return None
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return f"{path} (length)", len(a), len(b)
        for index, (x, y) in enumerate(zip(a, b, strict=True)):
            found = first_difference(x, y, f"{path}[{index}]")
            if found is not None:
                return found
        return None
    return None if a == b else (path, a, b)


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def failures_on_any_rank(
    collectives: Collectives, error: BaseException | None, name: str
) -> list[tuple[int, str]]:
    """(rank, message) of every rank whose `error` is not None, the same list on
    every rank: one allgather, which every rank reaches whether its own part
    succeeded or not, so a failure on one rank stops all of them at once
    instead of leaving the others waiting in their next collective."""
    message = None if error is None else f"{type(error).__name__}: {error}"
    everyone = collectives.allgather_object(message, name=name)
    return [(rank, text) for rank, text in enumerate(everyone) if text is not None]


def pin_gpu(local_rank: int) -> None:
    """One GPU per rank: rank `local_rank` of a node sees only GPU `local_rank`, and
    allocates its memory as needed (else every rank would claim every GPU). Must
    run before TensorFlow touches a GPU. No-op without GPUs (not exercised on the
    CPU-only CI machines)."""
    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        return
    gpu = gpus[local_rank % len(gpus)]
    tf.config.set_visible_devices(gpu, "GPU")
    tf.config.experimental.set_memory_growth(gpu, True)


def intra_op_threads_per_rank(cpus: int, local_ranks: int) -> int:
    """TensorFlow's intra-op threads for each of `local_ranks` ranks sharing
    `cpus` CPUs: a share each, at least one."""
    return max(1, cpus // max(1, local_ranks))


def cpu_slice(cpus: Sequence[int], local_ranks: int, local_rank: int) -> tuple[int, ...]:
    """Local rank `local_rank`'s own CPUs of `cpus`: consecutive slices, one per
    rank, the first `len(cpus) % local_ranks` ranks one CPU more; with more
    ranks than CPUs, ranks take turns over the CPUs (rank r gets CPU r mod n)."""
    cpus = sorted(cpus)
    if local_ranks >= len(cpus):
        return (cpus[local_rank % len(cpus)],)
    size, extra = divmod(len(cpus), local_ranks)
    start = local_rank * size + min(local_rank, extra)
    return tuple(cpus[start : start + size + (local_rank < extra)])


def format_cpus(cpus: Sequence[int]) -> str:
    """CPU ids as Linux lists them: ranges of consecutive ids ("0-3,8")."""
    spans: list[list[int]] = []
    for cpu in sorted(cpus):
        if spans and cpu == spans[-1][1] + 1:
            spans[-1][1] = cpu
        else:
            spans.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def bind_process(cpus: Sequence[int]) -> None:
    """Every thread of this process (Horovod's and Gloo's, started by
    `hvd.init()`, included) and those it starts later may run on `cpus` only."""
    for task in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(task), cpus)
        except ProcessLookupError:  # the thread has ended
            continue


def share_cpus(
    local_ranks: int, local_rank: int = 0, bind: bool = True
) -> tuple[tuple[int, ...] | None, int | None]:
    """Shares this host's CPUs among its `local_ranks` ranks; returns (the CPUs
    this rank was bound to or None, the intra-op threads set or None).

    With `bind`, when the process may run on every CPU of the host (no launcher
    or container bound it), each rank is bound to its own slice (`cpu_slice`)
    and TensorFlow sizes its pools to it. Left to the kernel, 2 ranks on 2
    cores swapped cores and cache, and one rank often ran ahead of the other
    and then waited for it in the next collective: 2 ranks, batch 8192, 26
    tables of 100,000 x 128 in chunks of 1024 rows, 2 alternating pairs:
    622-666 ms a step bound against 652-740 unbound, a rank waiting on
    collectives 3.0-6.4 % of the step against 3.5-11.2 % (`docs/performance.md`).

    Otherwise each rank gets its share of the CPUs it may run on as intra-op
    threads, at least one: by default every rank starts a pool as large as the
    machine, and with 2 ranks on 2 cores, 4 compute threads took turns on 2
    cores (918-967 ms a step against 887-889 ms with one thread each).
    `TF_NUM_INTRAOP_THREADS`, set by the user, leaves the threads to TensorFlow.
    Must run before TensorFlow runs an op."""
    if local_ranks <= 1:
        return None, None
    allowed = sorted(os.sched_getaffinity(0))
    bound = None
    if bind and len(allowed) == os.cpu_count():
        bound = cpu_slice(allowed, local_ranks, local_rank)
        bind_process(bound)
        threads = len(bound)
    else:
        threads = intra_op_threads_per_rank(len(allowed), local_ranks)
    if "TF_NUM_INTRAOP_THREADS" in os.environ:
        return bound, None
    try:
        tf.config.threading.set_intra_op_parallelism_threads(threads)
    except RuntimeError:  # the runtime has started: its pools stay as they are
        return bound, None
    return bound, threads


def create_collectives(bind_cpus: bool = True) -> Collectives:
    """Horovod's when launched by it (even with one rank), else the one-process
    kind. `bind_cpus`: see `share_cpus`."""
    return HorovodCollectives(bind_cpus) if launched_by_horovod() else Collectives()
