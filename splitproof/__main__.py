"""``python -m splitproof ...`` runs the ``splitproof`` command (what ``torchrun -m splitproof`` needs)."""

import sys

from splitproof.cli import main

if __name__ == "__main__":
    sys.exit(main())
