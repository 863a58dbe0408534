"""A verl-convention reward for tests: graded, so samples of one prompt score differently."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    digits = sum(ch.isdigit() for ch in solution_str)
    match = sum(a == b for a, b in zip(solution_str, ground_truth))
    return 0.1 * digits + 0.5 * match - 0.05 * len(solution_str)
