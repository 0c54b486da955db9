"""The OpenAI ingress in front of an InferenceDeployment's engines (no torch, no engine imports).

Only its command line exists in this build: `fleetserve router` parses every flag through
`fleetserve.api.router_config.RouterConfig` and then refuses to start (issue 15 builds the router).
"""
