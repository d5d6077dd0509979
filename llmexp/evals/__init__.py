"""Downstream tasks scored during training: task files and their checks (`items`), the scorers (`score`: the
log-likelihood of each choice, greedy generation), the extra held-out sets (`perplexity`), the shipped demo task
(`demo`) and the lm-evaluation-harness adapter (`harness`). Pure functions of a model and items: the train layer
decides when they run and how ranks share them (`llmexp.train.eval_suite`)."""
