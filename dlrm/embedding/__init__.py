"""Embedding tables behind one interface.

`LocalEmbeddings` holds every table on this process. The hybrid-parallel
implementation offers the same call (ids in, [B, T, D] vectors out) and the same
`table_slice`/`assign_table_slice` view for checkpoints, so the model, trainer
and `main.py` do not change when tables are sharded.
"""

from dlrm.embedding.initializer import initial_table_values
from dlrm.embedding.local import LocalEmbeddings, TableShardVariable

__all__ = ["LocalEmbeddings", "TableShardVariable", "initial_table_values"]
