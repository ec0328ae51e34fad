"""Prediction over batches and exact evaluation metrics over a whole split."""
