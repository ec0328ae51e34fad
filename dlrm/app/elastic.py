"""Training under Horovod Elastic (`horovodrun --host-discovery-script ... --min-np
M`): a job that loses a host goes on without it, and grows when a host joins.

When a rank is lost (its process or host gone, its link down), the collective the
others are in fails (at once for a closed connection, after
HOROVOD_GLOO_TIMEOUT_SECONDS for a silent peer). The survivors then leave that
world, and horovodrun's driver forms the next one from the hosts that are left
(at least --min-np ranks, else the job ends after --elastic-timeout). On it,
every survivor builds the run again from scratch: the tables re-planned for
the new world size, the model restored from the newest complete checkpoint in
--save_checkpoint_path (resharded), the reader at that checkpoint's sample
position. The steps since that checkpoint are trained again, nothing else.

When the discovery script lists a host again (after horovodrun's
--blacklist-cooldown-range) or a new one, the driver tells rank 0; the ranks see
it together after their next checkpoint (`ElasticMembership.check_host_updates`),
leave the world, and continue from that checkpoint with the new host's ranks.

The checkpoint is the only state: an attempt keeps nothing in memory that the
next one uses, so a run that lost and regained hosts ends with the weights of
one that did not (the N-rank = 1-rank invariant), its extra work being the
rolled-back steps. A run with no complete checkpoint to continue from stops.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time
from collections.abc import Callable
from typing import Any, TextIO

from dlrm.app.assembly import AssembledRun, assemble_run
from dlrm.app.config import ConfigError, RunConfig, check_world_size
from dlrm.app.modes.training import TrainProgress, train
from dlrm.app.reporting import MetricsLog
from dlrm.checkpoint.format import CheckpointError, newest_checkpoint
from dlrm.checkpoint.reader import Checkpoint
from dlrm.distributed.membership import ElasticMembership, HostsChanged, lost_a_rank, lost_peer

# Why a world ended.
LOST_A_RANK = "a rank was lost"
HOSTS_CHANGED = "the hosts changed"


@dataclasses.dataclass
class Continuation:
    """Why the last world ended and where the next one starts."""

    reason: str  # LOST_A_RANK or HOSTS_CHANGED
    at: float  # time.time() when this rank saw it
    step: int  # the last step every rank of that world finished
    checkpoint: Checkpoint
    hosts: list[str]  # rank r's hostname in that world

    @property
    def rolled_back_steps(self) -> int:
        """The steps that world trained after the checkpoint, to be trained again."""
        return max(0, self.step - self.checkpoint.step)


@dataclasses.dataclass
class ElasticTotals:
    """What the whole job did across its worlds, as this rank saw it."""

    resets: int = 0
    rolled_back_steps: int = 0  # trained again after a lost rank
    steps_trained: int = 0  # every step this rank trained, the rolled-back ones too
    worlds: list[int] = dataclasses.field(default_factory=list)  # each world's size

    def record(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def checkpoint_to_continue_from(directory: str, step: int, reason: str) -> Checkpoint:
    """The newest complete checkpoint in `directory` to continue from after the
    world ended at `step`; CheckpointError when there is none."""
    newest = newest_checkpoint(directory)
    if newest is None:
        raise CheckpointError(
            f"{reason} at step {step:,} and {directory} holds no complete checkpoint to "
            "continue from: set --checkpoint_every_steps or --checkpoint_every_seconds so "
            "that an elastic run has one"
        )
    return Checkpoint(newest)


def train_elastic(
    config: RunConfig,
    console: TextIO | None,
    report: Callable[[MetricsLog, dict[str, Any]], None],
) -> dict[str, Any]:
    """Trains across worlds until the run ends; `report(log, summary)` writes
    the summary with the last world's log. Raises what a world raised that was
    not a lost rank (bad data, a non-finite loss, ...)."""
    if not config.save_checkpoint_path:
        raise ConfigError(
            "under horovodrun --host-discovery-script (Horovod Elastic): needs "
            "--save_checkpoint_path, the checkpoints every new world continues from"
        )
    # Every world, a new worker's first one included, continues from the newest
    # checkpoint there: the same command serves the whole job.
    config = dataclasses.replace(config, resume=True)
    membership = ElasticMembership()
    totals = ElasticTotals()
    previous: Continuation | None = None
    try:
        while True:
            ended = train_world(config, console, report, membership, totals, previous)
            if not isinstance(ended, Continuation):
                return ended
            previous = ended
            totals.resets += 1
            membership.reset()
    finally:
        membership.close()


def train_world(
    config: RunConfig,
    console: TextIO | None,
    report: Callable[[MetricsLog, dict[str, Any]], None],
    membership: ElasticMembership,
    totals: ElasticTotals,
    previous: Continuation | None,
) -> dict[str, Any] | Continuation:
    """One world, from the checkpoint `previous` continued from (or the run's
    start): trains to the end and returns the summary, or returns where the next
    world continues after a rank was lost or the hosts changed."""
    collectives = membership.collectives(config.bind_cpus)
    # The launcher's HOROVOD_RANK is the first world's; errors are reported
    # once per job by the current rank 0 (`dlrm.distributed.launcher.reports`).
    os.environ["HOROVOD_RANK"] = str(collectives.rank)
    check_world_size(config, collectives.world_size)
    totals.worlds.append(collectives.world_size)
    log = MetricsLog(
        config.metrics_log_path, config.tensorboard_path, collectives.rank == 0, console
    )
    # Until the world trains, it stands where the last one left off.
    at = previous.checkpoint.step if previous is not None else 0
    progress = TrainProgress(start_step=at, step=at)
    run: AssembledRun | None = None
    try:
        run = assemble_run(config, log, collectives)
        if previous is not None:
            announce(run, previous, totals)
            progress.on_first_step = recovered(run, previous)
        summary = train(run, progress, after_checkpoint=membership.check_host_updates)
        totals.steps_trained += progress.step - progress.start_step
        summary["elastic"] = totals.record()
        report(log, summary)
        return summary
    except HostsChanged:
        reason, peer, ended_at = HOSTS_CHANGED, None, time.time()
    except Exception as error:
        if not lost_a_rank(error):
            raise
        reason, peer, ended_at = LOST_A_RANK, lost_peer(error), time.time()
    finally:
        log.close()
    totals.steps_trained += progress.step - progress.start_step
    # A world that failed before its run was built never learnt its hosts: the last
    # world's stand in for them in the report.
    if run is not None:
        hosts = run.hosts
    elif previous is not None:
        hosts = previous.hosts
    else:
        hosts = [socket.gethostname()]
    assert config.save_checkpoint_path
    checkpoint = checkpoint_to_continue_from(config.save_checkpoint_path, progress.step, reason)
    ended = Continuation(reason, ended_at, progress.step, checkpoint, hosts)
    if reason == LOST_A_RANK:
        totals.rolled_back_steps += ended.rolled_back_steps
        say_lost(ended, peer, collectives.world_size, console)
    return ended


def say_lost(
    ended: Continuation, peer: str | None, world_size: int, console: TextIO | None
) -> None:
    """Every survivor says it (rank 0 may be the one that was lost)."""
    print(
        f"elastic: {ended.reason}"
        + (f" ({peer})" if peer else "")
        + f" at step {ended.step:,} of a world of {world_size} ranks "
        f"({', '.join(ended.hosts)}); continuing from {ended.checkpoint.path} (step "
        f"{ended.checkpoint.step:,}) once horovodrun forms a world of at least --min-np "
        "ranks (it waits up to --elastic-timeout)",
        file=console,
        flush=True,
    )


def announce(run: AssembledRun, previous: Continuation, totals: ElasticTotals) -> None:
    """Rank 0 of the new world says how it differs from the last one."""
    lost = sorted(set(previous.hosts) - set(run.hosts))
    joined = sorted(set(run.hosts) - set(previous.hosts))
    changes = ([f"without {', '.join(lost)}"] if lost else []) + (
        [f"with {', '.join(joined)} joining"] if joined else []
    )
    run.log.print(
        f"elastic: {previous.reason}; continuing on {run.collectives.world_size} ranks"
        + (f" ({'; '.join(changes)})" if changes else "")
        + f" from {previous.checkpoint.path} (step {previous.checkpoint.step:,})"
        + (
            f", {previous.rolled_back_steps:,} steps to train again"
            if previous.reason == LOST_A_RANK
            else ""
        )
    )
    run.log.write(
        "elastic_reset",
        step=previous.checkpoint.step,
        reason=previous.reason,
        ended_at_step=previous.step,
        previous_hosts=previous.hosts,
        hosts=run.hosts,
        lost=lost,
        joined=joined,
        resets=totals.resets,
    )


def recovered(run: AssembledRun, previous: Continuation) -> Callable[[], None]:
    """What rank 0 logs after the first step of a new world: the time from the
    moment this rank saw the last world end to that step."""

    def log_it() -> None:
        seconds = time.time() - previous.at
        run.log.print(f"elastic: first step of the new world {seconds:.1f} s after the last")
        run.log.write("elastic_recovered", seconds=round(seconds, 3), reason=previous.reason)

    return log_it
