"""An independent, deliberately plain float64 oracle of every objective (docs/semantics.md).

The package shares no code with the rest of splitproof except :class:`LossConfig`. It computes the
objective of one whole optimizer minibatch in a single pass: per-sequence Python loops, vectorised
per-token work inside a sequence, everything in float64. It exists to check the fast path, so clarity
wins over speed.
"""

from splitproof.oracle.cov_choice import oracle_selection, priority_hash
from splitproof.oracle.oracle_policy import oracle_objective
from splitproof.oracle.value_loss import oracle_value_objective

__all__ = ["oracle_objective", "oracle_selection", "oracle_value_objective", "priority_hash"]
