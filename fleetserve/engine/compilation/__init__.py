"""Optimisation policy: the `-O` levels (`levels`)."""
