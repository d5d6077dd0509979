"""Downstream tasks scored during training, pure functions of a model and items: the train layer decides when they
run and how ranks share them (`llmexp.train.eval_suite`)."""
