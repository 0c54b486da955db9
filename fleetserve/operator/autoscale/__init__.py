"""The autoscaler: engine metrics → desired groups per role (issue 18).

`load` reads the engines' `/metrics`, `policy` is the pure decision, `replicas` is how the
reconcile learns the result, `loop` runs it in the operator, `sim_engine` and `trace` are the
torch-free simulated engines and traces the tests and figures run against.
"""
