"""Helpers to build tiny random-weight llama models on disk, for tests and quick experiments."""
