"""The built-in calculator tool (``actor_rollout_ref.rollout.multi_turn.function_tool_path``), for the
``builtin://product`` task: with the ``simple`` format the model calls it as ``mul(123,456)``."""


def mul(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the left factor
        b: the right factor
    """
    return a * b


class CalculatorEnv:
    """The calculator as an environment in TRL's ``environment_factory`` shape
    (``multi_turn.environment_factory=splitproof.builtin.calculator:CalculatorEnv``): ``reset`` keeps the
    row's factors and leaves the prompt as it is; ``mul`` is the episode's tool and counts its calls."""

    def reset(self, **row) -> None:
        self.factors = ((row.get("extra_info") or {}).get("a"), (row.get("extra_info") or {}).get("b"))
        self.calls = 0

    def mul(self, a: int, b: int) -> int:
        """Multiply two integers.

        Args:
            a: the left factor
            b: the right factor
        """
        self.calls += 1
        return a * b
