"""Hydra discovers llmexp's launchers here; the code lives in `llmexp.sweep.local`."""
