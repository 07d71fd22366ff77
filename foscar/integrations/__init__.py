"""Integrations with model libraries: :mod:`foscar.integrations.transformers` (Hugging Face)."""
