"""The error every batch check raises: it names the field, and the sequence where one applies."""

from __future__ import annotations


class BatchError(ValueError):
    """Bad input. ``field`` names the offending tensor; ``sequence`` the canonical id, when one applies."""

    def __init__(self, field: str, message: str, sequence: int | None = None):
        where = f" (sequence {sequence})" if sequence is not None else ""
        super().__init__(f"{field}{where}: {message}")
        self.field = field
        self.sequence = sequence
