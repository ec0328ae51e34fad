"""The DLRM model, its hybrid-parallel embeddings and the trainer (in progress)."""
