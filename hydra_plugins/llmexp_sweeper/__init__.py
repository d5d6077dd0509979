"""Hydra discovers llmexp's sweepers and their configs here; the work is done in `llmexp.sweep`."""
