"""Torch-free pieces shared by the engine, the router and the operator: block hashing, the metric
names, CPU threading and free ports. Nothing here imports fleetserve's other packages (except the
`fleetserve.envs` leaf) or any GPU library."""
