"""A verl-convention reward for tests whose dict holds an extra key ``first`` for some samples only: those
whose ground truth is listed in the environment variable ``PARTIAL_KEY_TRUTHS`` (comma-separated)."""

import os


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    digits = sum(ch.isdigit() for ch in solution_str)
    result = {"score": 0.1 * digits - 0.05 * len(solution_str), "length": float(len(solution_str))}
    if str(ground_truth) in os.environ.get("PARTIAL_KEY_TRUTHS", "").split(","):
        result["first"] = 1.0 + 0.01 * digits
    return result
