"""What a launcher (horovodrun, mpirun, srun with Horovod's environment) tells a
process before Horovod starts. Imports no TensorFlow, so that the command-line
entry points can use it before they decide how TensorFlow logs."""

from __future__ import annotations

import os
from collections.abc import Mapping

# The variables that carry a process's rank, by launcher: horovodrun (Gloo),
# OpenMPI's mpirun, MPICH/PMI and PMIx (srun --mpi=pmix).
RANK_VARIABLES = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")


def launcher_rank(environ: Mapping[str, str] | None = None) -> int | None:
    """This process's rank as its launcher set it, or None when no launcher did."""
    environ = os.environ if environ is None else environ
    for name in RANK_VARIABLES:
        value = environ.get(name)
        if value is not None and value.strip().isdigit():
            return int(value)
    return None


def launched_by_horovod(environ: Mapping[str, str] | None = None) -> bool:
    """True under horovodrun (or srun/mpirun with Horovod's MPI/Gloo environment)."""
    return launcher_rank(environ) is not None


def launched_elastic(environ: Mapping[str, str] | None = None) -> bool:
    """True under Horovod Elastic: horovodrun with --host-discovery-script."""
    environ = os.environ if environ is None else environ
    return environ.get("HOROVOD_ELASTIC") == "1" and launched_by_horovod(environ)


def reports(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process prints what every rank would print alike: one process
    of a job (rank 0), or a process that no launcher started."""
    return launcher_rank(environ) in (None, 0)


def same_on_every_rank(error: BaseException) -> bool:
    """Whether every rank of the job raised `error` alike, so that one rank's
    report says it all: errors of the settings (every rank checks the same
    flags) and errors the ranks agreed on through a collective carry a true
    `same_on_every_rank` attribute; any other error may be one rank's own."""
    return bool(getattr(error, "same_on_every_rank", False))
