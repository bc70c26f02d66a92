"""Integrations of kvactors with serving engines (each behind its own extra)."""
