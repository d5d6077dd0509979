"""Hydra discovers llmexp's launchers and their configs here; the work is done in `llmexp.sweep`."""
