"""`dlrm-train` (and `python main.py` in a checkout): DLRM training from the command line.

    dlrm-train --dataset_path DIR [--mode train|eval|inference|export] [flags]
    dlrm-train --flagfile run.flags
    horovodrun -np 2 dlrm-train --dataset_path DIR ...

This module parses the flags into one validated `RunConfig` (`dlrm.app.flags`),
decides how much TensorFlow logs (`dlrm.app.tensorflow_import`), runs the mode
(`dlrm.app.dispatch`) and turns errors into one message and an exit status.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from absl import app

from dlrm.app import flags as flags_module
from dlrm.app.config import ConfigError
from dlrm.app.flags import FLAGS, config_from_flags, resolve_flagfiles
from dlrm.app.tensorflow_import import quiet_logs
from dlrm.distributed import launcher as launch
from dlrm.distributed.preemption import EXIT_PREEMPTED

USAGE = """Trains, evaluates, benchmarks or exports a DLRM model.

    dlrm-train --dataset_path DIR [--mode train|eval|inference|export] [flags]
    dlrm-train --flagfile run.flags      (the packaged mlperf_dcnv2*.flags by name, too)
    horovodrun -np 2 dlrm-train ...      (hybrid-parallel: tables sharded over the ranks)
"""


# Seconds a rank that leaves an error to rank 0 waits before it exits (see `_error`).
REPORTER_GRACE_S = 5.0


def _error(message: str, same_on_every_rank: bool) -> None:
    """Prints `message` on stderr, once per job when every rank has it alike.

    The other ranks then wait up to `REPORTER_GRACE_S` before they exit: a
    launcher stops the whole job when its first rank exits, so a silent rank
    that exited first could have rank 0 killed before it printed the message
    (seen under horovodrun). Rank 0 exits right after printing, which ends the
    job without the wait."""
    if not same_on_every_rank or launch.reports():
        print(f"{_program()}: {message}", file=sys.stderr, flush=True)
    else:
        time.sleep(REPORTER_GRACE_S)


def _program() -> str:
    return Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "dlrm-train"


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        _error(f"unexpected arguments {argv[1:]}; every setting is a --flag", True)
        return 2
    try:
        config = config_from_flags()
    except ValueError as error:
        _error(f"invalid flags: {error}", True)
        return 2
    quiet_logs(bool(FLAGS["verbosity"].present) and FLAGS.verbosity >= 0)
    from dataloading.errors import DatasetError
    from dlrm.app.dispatch import run_mode
    from dlrm.app.modes.training import NothingToTrainError
    from dlrm.checkpoint.format import CheckpointError
    from dlrm.distributed.agreement import RankMismatchError
    from dlrm.distributed.devices import DeviceError
    from dlrm.embedding.planner.types import PlanError
    from dlrm.train.trainer import NonFiniteLossError
    from feature_spec import FeatureSpecError

    try:
        summary = run_mode(config)
    except NothingToTrainError as error:
        _error(str(error), True)
        return 2
    except ConfigError as error:  # settings that only the run can check (world size)
        _error(f"invalid flags: {error}", True)
        return 2
    except (FeatureSpecError, DatasetError, CheckpointError, PlanError, RankMismatchError) as error:
        _error(str(error), launch.same_on_every_rank(error))
        return 1
    except DeviceError as error:  # more ranks on a host than GPUs: said by each rank there
        _error(str(error), launch.same_on_every_rank(error))
        return 1
    except NonFiniteLossError as error:
        _error(str(error), launch.same_on_every_rank(error))
        return 3
    if summary.get("preempted"):
        _error(preempted_message(summary), True)
        return EXIT_PREEMPTED
    return 0


def preempted_message(summary: dict[str, object]) -> str:
    """What a run stopped by a preemption signal says, from its summary."""
    checkpoint = summary.get("checkpoint")
    return f"stopped at step {summary['steps']} by a preemption signal; " + (
        f"checkpoint {checkpoint}: the same command with --resume continues it"
        if checkpoint
        else "no checkpoint written (no --save_checkpoint_path)"
    )


def console_main() -> None:
    """The `dlrm-train` command (and `python main.py`)."""
    main_module = sys.modules["__main__"]
    if not main_module.__doc__:  # absl's --help shows it; an installed command's has none
        main_module.__doc__ = USAGE
    # --help lists the main module's flags: ours, defined in dlrm.app.flags.
    for flag in FLAGS.get_flags_for_module(flags_module.__name__):
        FLAGS.register_key_flag_for_module(sys.argv[0], flag)
    app.run(lambda argv: sys.exit(main(argv)), argv=resolve_flagfiles(sys.argv))
