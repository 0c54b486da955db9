"""`python -m fleetserve ...` is the `fleetserve` CLI."""

from fleetserve.cli import main

raise SystemExit(main())
