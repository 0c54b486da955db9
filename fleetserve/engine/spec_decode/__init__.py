"""Speculative decoding (seed notes part 3 §2.5): proposers, verification, KV rollback.

Each step a proposer drafts up to k tokens per decoding request (`ngram`: prompt lookup, no
model; `draft_model`: a small model of the same vocabulary with its own KV caches); the scheduler
schedules them after the request's real token (`scheduling`), the target verifies all of them in
one forward pass and `rejection_sampler` keeps the accepted prefix plus one token of its own, so
the output distribution is exactly the target's. The scheduler rolls `num_computed_tokens` back
over the rejected drafts; their KV slots are rewritten by later steps and never indexed in the
prefix cache (hashes cover only accepted tokens).
"""
