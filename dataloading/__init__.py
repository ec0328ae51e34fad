"""Reading split-binary datasets per rank (tf.data), and generating synthetic ones.

`dataloading.split_binary` imports TensorFlow; the other modules are numpy only,
so generators and file checks do not pay for the TensorFlow import.
"""
