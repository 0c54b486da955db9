"""`python -m fleetserve.devcluster up|down|status|logs` (same as `fleetserve dev-cluster ...`)."""

from __future__ import annotations

import sys

from fleetserve.devcluster.cli import main

if __name__ == "__main__":
    sys.exit(main())
