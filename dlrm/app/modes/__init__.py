"""One module per `--mode`: training (the loop), evaluation, inference and export."""
