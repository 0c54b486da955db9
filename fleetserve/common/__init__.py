"""Torch-free pieces shared by the engine, the router and the operator: block hashing and the
metric names. Nothing here imports fleetserve's other packages or any GPU library."""
