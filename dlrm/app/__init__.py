"""The application behind `dlrm-train`: flags, the TensorFlow import, dispatch to a
mode, assembling a run, the training loop and its policies, the other modes,
Horovod Elastic and reporting. The top layer: it imports the library below, and
nothing imports it."""
