"""The local fleet on one machine (`fleetserve up`) and its process supervisor (no torch)."""
