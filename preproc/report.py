"""The run report: rows and positive rate per split, malformed lines per reason,
cardinality and OOV rate per feature, stage timings. Written as `report.json` and
printed as a table.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from feature_spec import FeatureSpec
from preproc.config import PipelineConfig
from preproc.parse import HEADER, MALFORMED_REASONS


def build_report(
    config: PipelineConfig,
    spec: FeatureSpec,
    parse_summary: Mapping[str, Any],
    vocabulary_summary: Mapping[str, Any],
    split_summaries: Mapping[str, Mapping[str, Any]],
    timings: Mapping[str, Mapping[str, Any]],
) -> dict[str, Any]:
    """The report as a JSON-serialisable dict."""
    layout = config.layout
    malformed = {
        r: sum(f["malformed"][r] for f in parse_summary["files"]) for r in MALFORMED_REASONS
    }
    splits = {}
    for mapping in config.mappings:
        summary = split_summaries[mapping]
        rows = summary["rows"]
        splits[mapping] = {
            "rows": rows,
            "positives": summary["positives"],
            "positive_rate": summary["positives"] / rows if rows else 0.0,
        }
    categorical = []
    for index, column in enumerate(layout.categorical):
        feature = spec.features[column.name]
        entry = vocabulary_summary["features"][index]
        ids = {m: split_summaries[m]["ids"][index] for m in config.mappings}
        categorical.append(
            {
                "name": column.name,
                "source": column.source,
                "kind": column.kind.value,
                "frequency_threshold": (
                    config.frequency_thresholds[index] if column.uses_vocabulary else None
                ),
                "distinct_in_train": entry["distinct"],
                "cardinality": feature.cardinality,
                "dtype": feature.dtype,
                # Of the ids written: a variable-length feature has any number a row.
                "oov_rate": {
                    m: _rate(split_summaries[m]["zero_ids"][index], ids[m]) for m in config.mappings
                },
            }
        )
    numerical = [
        {
            "name": column.name,
            "source": column.source,
            "saturated": {m: split_summaries[m]["saturated"][i] for m in config.mappings},
        }
        for i, column in enumerate(layout.numerical)
    ]
    return {
        "output_dir": str(config.output_dir),
        "source": config.source,
        "numerical_transform": config.numerical_transform.value,
        "shuffle_train": config.shuffle_train,
        "seed": config.seed,
        "files": parse_summary["files"],
        "lines": sum(f["lines"] for f in parse_summary["files"]),
        "header_lines": sum(f[HEADER] for f in parse_summary["files"]),
        "malformed": malformed,
        "malformed_total": sum(malformed.values()),
        "malformed_examples": parse_summary["examples"],
        "splits": splits,
        "categorical": categorical,
        "numerical": numerical,
        "stages": dict(timings),
    }


def _rate(count: int, total: int) -> float:
    return count / total if total else 0.0


def format_report(report: Mapping[str, Any]) -> str:
    """The report as a plain-text table."""
    mappings = list(report["splits"])
    lines = [f"Preprocessed dataset: {report['output_dir']}", ""]
    lines.append(_table(
        ["split", "rows", "positives", "positive rate"],
        [
            [m, f"{s['rows']:,}", f"{s['positives']:,}", f"{100 * s['positive_rate']:.2f}%"]
            for m, s in report["splits"].items()
        ],
    ))  # fmt: skip
    reasons = ", ".join(f"{r} {n:,}" for r, n in report["malformed"].items())
    lines += [
        "",
        f"input: {len(report['files'])} files, {report['lines']:,} lines; "
        f"{report['malformed_total']:,} malformed lines skipped ({reasons}); "
        f"{report['header_lines']:,} header lines skipped",
    ]
    for example in report["malformed_examples"][:3]:
        lines.append(f"  e.g. {example['file']}:{example['line']}: {example['detail']}")
    lines.append("")
    header = ["feature", "source", "threshold", "distinct", "cardinality", "dtype"]
    header += [f"oov {m}" for m in mappings]
    rows = [
        [
            c["name"],
            c["source"],
            "-" if c["frequency_threshold"] is None else str(c["frequency_threshold"]),
            f"{c['distinct_in_train']:,}" if c["kind"] != "id" else "-",
            f"{c['cardinality']:,}",
            c["dtype"],
            *(f"{100 * c['oov_rate'][m]:.2f}%" for m in mappings),
        ]
        for c in report["categorical"]
    ]
    lines.append(_table(header, rows))
    saturated = sum(sum(n["saturated"].values()) for n in report["numerical"])
    lines += [
        "",
        f"numerical: {len(report['numerical'])} features, transform "
        f"{report['numerical_transform']}, {saturated:,} values clipped to the float16 range",
    ]
    stages = ", ".join(
        f"{name} {entry['seconds']:.1f} s" + (" (earlier run)" if entry["skipped"] else "")
        for name, entry in report["stages"].items()
    )
    lines.append(f"stages: {stages}")
    return "\n".join(lines)


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    out = []
    for row in [header, *rows]:
        cells = [
            str(cell).ljust(width) if i == 0 else str(cell).rjust(width)
            for i, (cell, width) in enumerate(zip(row, widths, strict=True))
        ]
        out.append("  ".join(cells).rstrip())
    return "\n".join(out)
