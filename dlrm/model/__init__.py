"""The DLRM model, written unsharded: its configuration, the interactions, the
dense part's row chunks, and export to a SavedModel."""
