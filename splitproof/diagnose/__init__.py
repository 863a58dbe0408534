"""Diagnosis: rerun one update under different splits and compare (docs/diagnose.md)."""
