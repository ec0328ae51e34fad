"""The application behind `dlrm-train` (`main.py`): runs one mode of a validated
`RunConfig` and reports its summary. Assembling a run is `dlrm.app.assembly`'s
job; each mode has its module in `dlrm.app.modes` (training: the loop).
"""

from __future__ import annotations

from typing import Any, TextIO

from dlrm.app.assembly import assemble_run
from dlrm.app.config import ConfigError, RunConfig, check_world_size
from dlrm.app.modes.evaluation import run_eval
from dlrm.app.modes.export import run_export
from dlrm.app.modes.inference import run_inference
from dlrm.app.modes.training import train
from dlrm.app.reporting import MetricsLog, format_duration
from dlrm.distributed.collectives import create_collectives
from dlrm.distributed.launcher import launched_by_horovod, launched_elastic


def run_mode(config: RunConfig, console: TextIO | None = None) -> dict[str, Any]:
    """Runs `config.mode`; returns the summary record (also logged by rank 0)."""
    if config.mode == "export" and launched_by_horovod():
        raise ConfigError(
            "--mode export: run it as one process (python main.py ...), not under "
            "horovodrun/srun/mpirun: every rank would write the same SavedModel"
        )
    if launched_elastic():
        if config.mode != "train":
            raise ConfigError(
                f"--mode {config.mode}: Horovod Elastic (horovodrun --host-discovery-script) "
                "runs --mode train only; launch the other modes with horovodrun -np N -H ..."
            )
        from dlrm.app.elastic import train_elastic

        return train_elastic(config, console, report_summary)
    # Export is one process (refused under a launcher above): pinned to one GPU.
    collectives = create_collectives(config.bind_cpus)
    check_world_size(config, collectives.world_size)
    log = MetricsLog(
        config.metrics_log_path,
        config.tensorboard_path,
        enabled=collectives.rank == 0,
        console=console,
    )
    try:
        if config.mode == "export":
            summary = run_export(config, log)
        else:
            run = assemble_run(config, log, collectives)
            if config.mode == "train":
                summary = train(run)
            elif config.mode == "eval":
                summary = run_eval(run)
            else:
                summary = run_inference(run)
        report_summary(log, summary)
        return summary
    finally:
        log.close()


def report_summary(log: MetricsLog, summary: dict[str, Any]) -> None:
    """The summary record, and its one console line."""
    log.write("summary", **summary)
    log.print(
        "summary: "
        + ", ".join(
            f"{key} {value:.5g}" if isinstance(value, float) else f"{key} {value}"
            for key, value in summary.items()
        )
        + (f" (wall {format_duration(summary['wall_time_s'])})" if "wall_time_s" in summary else "")
    )
