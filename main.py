"""DLRM training entry point: `python main.py --dataset_path DIR [flags]`.

Training, evaluation, inference and export land with the model/training issue;
until then this entry point says so instead of pretending to train.
"""

import sys


def main() -> int:
    print(
        "main.py: training is not implemented yet (it lands with the DLRM model and "
        "training issue). Available now: FeatureSpec datasets (feature_spec/), the "
        "per-rank loader (dataloading/split_binary.py) and synthetic data "
        "(python -m dataloading.synthetic).",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main())
