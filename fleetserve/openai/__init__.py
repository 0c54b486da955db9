"""The OpenAI HTTP protocol, torch-free: request/response bodies and OpenAI-shaped errors.

Shared by the engine's API server and the router (which never loads torch or the engine):
`protocol` holds the pydantic bodies (unknown fields ignored, as vLLM does), `errors` the error
body, `RequestError`, `parse_body` and the aiohttp error and auth middlewares. Nothing here
imports `fleetserve.engine`, `fleetserve.server`, torch or transformers (an import-linter
contract in pyproject.toml keeps it so).
"""
