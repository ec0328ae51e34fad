"""Serves SavedModels as a client would, where this project cannot be imported:

    python -I -S serve_without_the_project.py SITE_PACKAGES INPUTS.npz OUTPUT.npz MODEL_DIR...

Run isolated (`-I`: no PYTHONPATH, no user site, not the script's directory; `-S`:
no site-packages, so none of their `.pth` files, among them the project's editable
install). SITE_PACKAGES (TensorFlow's) is put on the path as a plain directory. The
script fails unless `dlrm`, `dataloading` and `feature_spec` cannot be imported.

Writes OUTPUT.npz: for model k (in the order given), `probability_k` (the serving
signature's output on INPUTS.npz, all rows at once), and from its variables
checkpoint `table_bytes_k` (the variables under `tables/`) and `dense_bytes_k` (the
others), and `variables_bytes_k` (the size of its variables/ directory on disk).
"""

import importlib
import os
import sys


def assert_project_not_importable() -> None:
    for name in ("dlrm", "dataloading", "feature_spec"):
        try:
            importlib.import_module(name)
        except ImportError:
            continue
        raise SystemExit(f"{name} is importable from {sys.path}: the isolation failed")


def variable_bytes(model_dir: str) -> tuple[int, int]:
    """(bytes of the variables under `tables/`, bytes of the others)."""
    import tensorflow as tf

    reader = tf.train.load_checkpoint(os.path.join(model_dir, "variables", "variables"))
    shapes, dtypes = reader.get_variable_to_shape_map(), reader.get_variable_to_dtype_map()
    tables = dense = 0
    for name, shape in shapes.items():
        if name == "_CHECKPOINTABLE_OBJECT_GRAPH":
            continue
        size = dtypes[name].size
        for extent in shape:
            size *= extent
        if name.startswith("tables/"):
            tables += size
        else:
            dense += size
    return tables, dense


def directory_bytes(path: str) -> int:
    return sum(
        os.path.getsize(os.path.join(root, name))
        for root, _, names in os.walk(path)
        for name in names
    )


def main() -> None:
    site_packages, inputs_path, output_path, *model_dirs = sys.argv[1:]
    assert_project_not_importable()
    sys.path.append(site_packages)
    assert_project_not_importable()  # nor from TensorFlow's site-packages

    import numpy as np
    import tensorflow as tf

    inputs = np.load(inputs_path)
    feeds = {name: tf.constant(inputs[name]) for name in inputs.files}
    results = {}
    for index, model_dir in enumerate(model_dirs):
        serve = tf.saved_model.load(model_dir).signatures["serving_default"]
        results[f"probability_{index}"] = serve(**feeds)["probability"].numpy()
        tables, dense = variable_bytes(model_dir)
        results[f"table_bytes_{index}"] = np.int64(tables)
        results[f"dense_bytes_{index}"] = np.int64(dense)
        variables = os.path.join(model_dir, "variables")
        results[f"variables_bytes_{index}"] = np.int64(directory_bytes(variables))
    np.savez(output_path, **results)


if __name__ == "__main__":
    main()
