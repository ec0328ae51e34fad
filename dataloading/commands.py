"""`dlrm-synthetic`: generated data to try the product on, from any directory.

    dlrm-synthetic dataset --output_dir data/ --train_rows 100000 --test_rows 20000
    dlrm-synthetic clicklog --output_dir raw/ --days 3 --rows_per_day 100000

`dataset` writes a split-binary dataset with its `feature_spec.yaml`, ready for
`dlrm-train` (`python -m dataloading.synthetic` in a checkout). `clicklog` writes
day files of raw Criteo-format lines, for `dlrm-preprocess` (`python -m
dataloading.criteo_tsv`). `dlrm-synthetic dataset --help` lists the options.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

from dataloading import criteo_tsv, synthetic

PROGRAM = "dlrm-synthetic"
COMMANDS: dict[str, tuple[Callable[[Sequence[str], str], int], str]] = {
    "dataset": (synthetic.main, "a split-binary dataset and its feature_spec.yaml"),
    "clicklog": (criteo_tsv.main, "day files of raw Criteo-format click-log lines"),
}


def usage() -> str:
    lines = [f"usage: {PROGRAM} {{{','.join(COMMANDS)}}} [options]", ""]
    lines += [f"  {name:<9} {what}" for name, (_, what) in COMMANDS.items()]
    lines += ["", f"{PROGRAM} COMMAND --help lists a command's options."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(usage())
        return 0 if args else 2
    name, *rest = args
    if name not in COMMANDS:
        print(
            f"{PROGRAM}: unknown command {name!r}; expected one of {', '.join(COMMANDS)}",
            file=sys.stderr,
        )
        return 2
    command, _ = COMMANDS[name]
    return command(rest, f"{PROGRAM} {name}")
