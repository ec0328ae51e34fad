"""Runs main.py with a fault injected on one rank, as a full disk or a dying
file server would cause it.

Usage: fail_on_rank.py RANK CALL AFTER main.py-flags...
On rank RANK (HOROVOD_RANK), once AFTER checkpoints have been written (CALL
`save`: `CheckpointWriter.add_table_shard` fails for later steps) or read (CALL
`restore`: `Checkpoint.restore_table_slice` fails in later checkpoints), the
call raises `OSError(ENOSPC)`. Other ranks run main.py unchanged.
"""

import errno
import os
import sys
import time

from absl import app

from dlrm.app import cli
from dlrm.checkpoint.reader import Checkpoint
from dlrm.checkpoint.writer import CheckpointWriter

TARGETS = {
    "save": (CheckpointWriter, "add_table_shard"),
    "restore": (Checkpoint, "restore_table_slice"),
}


def inject(call: str, after: int) -> None:
    owner, name = TARGETS[call]
    original = getattr(owner, name)
    seen: list[int] = []  # the writers or checkpoints called, in order

    def failing(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        if id(self) not in seen:
            seen.append(id(self))
        if seen.index(id(self)) >= after:
            # When, for benchmarks/failure_time.py: how long until every rank stops.
            print(f"injected failure at {time.time():.3f}", file=sys.stderr, flush=True)
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        return original(self, *args, **kwargs)

    setattr(owner, name, failing)


if __name__ == "__main__":
    rank, call, after, *flags = sys.argv[1:]
    if os.environ.get("HOROVOD_RANK") == rank:
        inject(call, int(after))
    app.run(lambda argv: sys.exit(cli.main(argv)), argv=["main.py", *flags])
