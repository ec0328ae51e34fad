"""Spark preprocessing of raw click logs into split binary files + FeatureSpec.

- `python -m preproc.criteo`: Criteo-format day files (plain or .gz);
- `python -m preproc.transcode`: your own CSV/TSV files described by a FeatureSpec.

Both run the same resumable pipeline (`preproc.pipeline`): parse and validate lines,
count vocabularies on the train split, encode, order and write each split, then
`feature_spec.yaml` and `report.json`. See docs/preprocessing.md.
"""
