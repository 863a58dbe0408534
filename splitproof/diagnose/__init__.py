"""Diagnosis: rerun one update under different splits and compare (SPEC §6)."""
