"""Spark preprocessing of raw click logs into split binary + FeatureSpec (in progress)."""
