"""A verifiers ToolEnv in the library's own API: a typed, docstring'd Python function is the tool; the
episode ends when a turn calls no tool (ToolEnv's own stop) or after max_turns."""

import verifiers as vf
from datasets import Dataset


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        Their sum.
    """
    return a + b


def load_environment(**kwargs) -> vf.Environment:
    dataset = Dataset.from_list([{"question": "2+3?", "answer": "5"}])

    def correct(completion, answer, **kwargs) -> float:
        return 1.0 if answer in str(completion[-1].content or "") else 0.0

    return vf.ToolEnv(dataset=dataset, tools=[add], rubric=vf.Rubric(funcs=[correct]), max_turns=4)
