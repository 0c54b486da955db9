"""KV-cache transfer between engines (P/D disaggregation): the connector API and its transports.

The connector has two roles kept apart (seed notes part 2 §2.7): the scheduler role decides which
tokens come from a remote engine and when blocks may be freed, and never touches tensors; the
worker role moves the bytes and makes no scheduling decision.
"""
