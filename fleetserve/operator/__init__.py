"""The kopf operator: thin handlers over pure builders (no torch, no engine imports)."""
