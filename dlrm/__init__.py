"""The DLRM model, its hybrid-parallel embeddings, the trainer and the application."""
