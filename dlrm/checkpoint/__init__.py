"""Checkpoints: the format (`format`: the directory layout, the manifest's types),
writing (`writer`) and reading (`reader`) it, a model's weights from one
(`model_state`), and the steps every rank runs and fails together (`every_rank`).
A trainer's whole state is `dlrm.train.state`'s."""
