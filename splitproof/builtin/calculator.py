"""The built-in calculator tool (``actor_rollout_ref.rollout.multi_turn.function_tool_path``), for the
``builtin://product`` task: with the ``simple`` format the model calls it as ``mul(123,456)``."""


def mul(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the left factor
        b: the right factor
    """
    return a * b
