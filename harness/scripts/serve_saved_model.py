"""Loads a SavedModel in a fresh process, with nothing from this project, and
writes its predictions: serve_saved_model.py MODEL_DIR INPUTS.npz OUTPUT.npy"""

import sys

import numpy as np
import tensorflow as tf


def main() -> None:
    model_dir, inputs_path, output_path = sys.argv[1:4]
    inputs = np.load(inputs_path)
    serve = tf.saved_model.load(model_dir).signatures["serving_default"]
    result = serve(**{name: tf.constant(inputs[name]) for name in inputs.files})
    np.save(output_path, result["probability"].numpy())


if __name__ == "__main__":
    main()
