"""Plugins by entry points: extend fleetserve without forking it (`loader`)."""
