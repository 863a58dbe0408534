"""A verl-convention reward for dynamic-sampling tests: a graded score (so advantages spread) and a binary
``acc`` that is the same for every sample of many groups (so filtering on it drops groups)."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    digits = sum(ch.isdigit() for ch in solution_str)
    match = sum(a == b for a, b in zip(solution_str, ground_truth))
    return {"score": 0.1 * digits + 0.5 * match - 0.05 * len(solution_str), "acc": float(digits >= 2)}
