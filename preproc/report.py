"""The run report: rows and positive rate per split, malformed lines per reason,
cardinality and OOV rate per feature (with a carried vocabulary, also the earlier
cardinality and the share of new ids per split), stage timings. Written as
`report.json` and printed as a table.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from feature_spec import TRAIN_MAPPING, FeatureSpec
from feature_spec.vocabulary import METADATA_KEY
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
    malformed = {
        r: sum(f["malformed"][r] for f in parse_summary["files"]) for r in MALFORMED_REASONS
    }
    return {
        "output_dir": str(config.output_dir),
        "source": config.source,
        "vocabulary": spec.metadata.get(METADATA_KEY),
        "vocabulary_from": None if config.vocabulary_from is None else str(config.vocabulary_from),
        "numerical_transform": config.numerical_transform.value,
        "shuffle_train": config.shuffle_train,
        "seed": config.seed,
        "files": parse_summary["files"],
        "lines": sum(f["lines"] for f in parse_summary["files"]),
        "header_lines": sum(f[HEADER] for f in parse_summary["files"]),
        "malformed": malformed,
        "malformed_total": sum(malformed.values()),
        "malformed_examples": parse_summary["examples"],
        "splits": _split_entries(config.mappings, split_summaries),
        "categorical": _categorical_entries(config, spec, vocabulary_summary, split_summaries),
        "numerical": _numerical_entries(config, split_summaries),
        "stages": dict(timings),
    }


def _split_entries(
    mappings: Sequence[str], split_summaries: Mapping[str, Mapping[str, Any]]
) -> dict[str, dict[str, Any]]:
    """Per mapping: rows, positives and positive rate."""
    splits = {}
    for mapping in mappings:
        summary = split_summaries[mapping]
        rows = summary["rows"]
        splits[mapping] = {
            "rows": rows,
            "positives": summary["positives"],
            "positive_rate": summary["positives"] / rows if rows else 0.0,
        }
    return splits


def _categorical_entries(
    config: PipelineConfig,
    spec: FeatureSpec,
    vocabulary_summary: Mapping[str, Any],
    split_summaries: Mapping[str, Mapping[str, Any]],
) -> list[dict[str, Any]]:
    """Per categorical feature: its vocabulary, cardinality and OOV (and new id) rates."""
    categorical = []
    for index, column in enumerate(config.layout.categorical):
        feature = spec.features[column.name]
        entry = vocabulary_summary["features"][index]
        ids = {m: split_summaries[m]["ids"][index] for m in config.mappings}
        previous = entry["previous_cardinality"]
        categorical.append(
            {
                "name": column.name,
                "source": column.source,
                "kind": column.kind.value,
                "frequency_threshold": (
                    config.frequency_thresholds[index] if column.uses_vocabulary else None
                ),
                "distinct_in_train": entry["distinct"],
                "oov_buckets": config.oov_buckets if column.uses_vocabulary else 0,
                # With --vocabulary_from: the cardinality there (else None).
                "previous_cardinality": previous,
                "cardinality": feature.cardinality,
                "dtype": feature.dtype,
                # Of the ids written (a variable-length feature has any number a row):
                # those of no value of their own, id 0 or an OOV bucket.
                "oov_rate": {
                    m: _rate(
                        split_summaries[m]["zero_ids"][index]
                        + split_summaries[m]["bucket_ids"][index],
                        ids[m],
                    )
                    for m in config.mappings
                },
                # With --vocabulary_from: of the ids written, those >= the previous
                # cardinality (values that had no id there); else None.
                "new_id_rate": None
                if previous is None
                else {
                    m: _rate(split_summaries[m]["new_ids"][index], ids[m]) for m in config.mappings
                },
            }
        )
    return categorical


def _numerical_entries(
    config: PipelineConfig, split_summaries: Mapping[str, Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """Per numerical feature: the values clipped to the float16 range, per mapping."""
    return [
        {
            "name": column.name,
            "source": column.source,
            "saturated": {m: split_summaries[m]["saturated"][i] for m in config.mappings},
        }
        for i, column in enumerate(config.layout.numerical)
    ]


def _rate(count: int, total: int) -> float:
    return count / total if total else 0.0


def format_report(report: Mapping[str, Any]) -> str:
    """The report as a plain-text table."""
    lines = [f"Preprocessed dataset: {report['output_dir']}", ""]
    lines.append(_splits_table(report))
    lines += ["", *_input_lines(report), ""]
    lines += _vocabulary_lines(report)
    lines.append(_categorical_table(report))
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


def _splits_table(report: Mapping[str, Any]) -> str:
    return _table(
        ["split", "rows", "positives", "positive rate"],
        [
            [m, f"{s['rows']:,}", f"{s['positives']:,}", f"{100 * s['positive_rate']:.2f}%"]
            for m, s in report["splits"].items()
        ],
    )


def _input_lines(report: Mapping[str, Any]) -> list[str]:
    """The lines read and skipped, with the first malformed ones."""
    reasons = ", ".join(f"{r} {n:,}" for r, n in report["malformed"].items())
    lines = [
        f"input: {len(report['files'])} files, {report['lines']:,} lines; "
        f"{report['malformed_total']:,} malformed lines skipped ({reasons}); "
        f"{report['header_lines']:,} header lines skipped",
    ]
    for example in report["malformed_examples"][:3]:
        lines.append(f"  e.g. {example['file']}:{example['line']}: {example['detail']}")
    return lines


def _vocabulary_lines(report: Mapping[str, Any]) -> list[str]:
    """What a carried vocabulary and the OOV buckets mean (none without either)."""
    vocabulary = report.get("vocabulary") or {}
    lines = []
    if report.get("vocabulary_from"):
        lines.append(
            f"vocabulary {vocabulary.get('id')}: carries {report['vocabulary_from']} "
            f"({vocabulary.get('extends', [None])[0]}) forward; 'new' is the share of ids "
            f"the earlier dataset did not have"
        )
    if vocabulary.get("oov_buckets"):
        lines.append(f"OOV buckets: ids 1..{vocabulary['oov_buckets']} hold rare and unseen values")
    if lines:
        lines.append("")
    return lines


def _categorical_table(report: Mapping[str, Any]) -> str:
    """A row per categorical feature; with a carried vocabulary, also the earlier
    cardinality and the share of new ids per later split."""
    mappings = list(report["splits"])
    carried = any(c.get("previous_cardinality") is not None for c in report["categorical"])
    later = [m for m in mappings if m != TRAIN_MAPPING]
    header = ["feature", "source", "threshold", "distinct"]
    header += ["old cardinality", "cardinality"] if carried else ["cardinality"]
    header += ["dtype", *(f"oov {m}" for m in mappings)]
    header += [f"new {m}" for m in later] if carried else []
    rows = []
    for c in report["categorical"]:
        row = [
            c["name"],
            c["source"],
            "-" if c["frequency_threshold"] is None else str(c["frequency_threshold"]),
            f"{c['distinct_in_train']:,}" if c["kind"] != "id" else "-",
        ]
        if carried:
            row.append(f"{c['previous_cardinality']:,}")
        row += [f"{c['cardinality']:,}", c["dtype"]]
        row += [f"{100 * c['oov_rate'][m]:.2f}%" for m in mappings]
        if carried:
            row += [f"{100 * c['new_id_rate'][m]:.2f}%" for m in later]
        rows.append(row)
    return _table(header, rows)


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
