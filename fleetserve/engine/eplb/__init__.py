"""Expert-parallel load balancing (EPLB): measured expert load → DeepSeek's placement →
expert weights moved between EP ranks (see `state` for the step cycle)."""
