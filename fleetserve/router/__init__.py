"""The OpenAI router in front of an InferenceDeployment's engines (no torch, no engine imports).

`policy` (pure decisions), `prefix_cache` and `breaker` (pure state), `fleet` (engine state and
the /metrics scraper), `discovery` (static URLs or Kubernetes pods), `prompt` (tokens and block
hashes), `forward` (the P/D legs, retries), `admission` (bounded queue), `app` (`create_app`),
`cli` (`fleetserve router`).
"""
