"""Errors of the advantage estimators: every one is a ``ValueError`` that names the estimator."""

from __future__ import annotations


class AdvantageError(ValueError):
    """Bad input to an advantage estimator. ``estimator`` names it; the message names the field and row."""

    def __init__(self, estimator: str, message: str):
        super().__init__(f"adv_estimator {estimator!r}: {message}")
        self.estimator = estimator


class UnknownEstimatorError(AdvantageError):
    """The estimator name is not one of ``ESTIMATORS``; the message lists them."""

    def __init__(self, estimator: str, known: tuple[str, ...]):
        super().__init__(estimator, f"unknown advantage estimator; known: {', '.join(known)}")


class AdvantageOptionError(AdvantageError):
    """An option is missing, unknown or out of range. ``option`` names it."""

    def __init__(self, estimator: str, option: str, message: str):
        super().__init__(estimator, f"option {option!r} {message}")
        self.option = option


class GroupsRequiredError(AdvantageError):
    """The estimator compares the samples of one prompt, and a prompt has fewer than two."""
