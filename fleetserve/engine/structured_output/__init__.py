"""Structured output: grammar-constrained decoding (seed notes part 2 §2.2).

Flow of one constrained request through the engine core:

1. `SamplingParams.structured_outputs` (a `StructuredOutputsParams`, validated in the API
   server) reaches `Scheduler.add_request`, which calls `StructuredOutputManager.init_request`:
   the grammar compiles in the manager's thread pool (or comes from its cache) while the
   request waits in `RequestStatus.WAITING_FOR_GRAMMAR`, outside the waiting queue, so it
   neither runs nor blocks anyone. Once compiled it joins the waiting queue; a compile that
   fails finishes only that request, with an error that starts with `INVALID_GRAMMAR`
   (`fleetserve.common.error_codes`), which the server answers as a 400.
2. Each step the scheduler asks `manager.grammar_bitmask(...)` for the rows of the constrained
   requests that sample this step (a prefill chunk that does not reach the end samples
   nothing and needs no row). The `GrammarBitmask` (numpy int32, one bit per token, set =
   allowed) rides in `SchedulerOutput.grammar_bitmask`; the runner gathers its sampling rows
   (`bitmask.batch_bitmask`, all ones for unconstrained rows) and the sampler sets the
   disallowed logits to -inf (`bitmask.apply_token_bitmask`) after the raw-logprobs snapshot.
3. `update_from_output` advances the request's grammar by the tokens it kept. The grammar
   state lives with the request in the core, so it survives preemption and recompute.

Speculative decoding (the scheduler passes drafts; this package provides and tests the rest;
`scheduling.StructuredOutputScheduling.bitmask(..., draft_token_ids=...)` and `.valid_drafts`
are the scheduler-side entry points, the scheduled token counts include the drafts):

- `manager.grammar_bitmask(grammars, draft_token_ids={req_id: [d0, ..., dk-1]})` gives that
  request 1 + k rows at `row_of[req_id]`: row i is the mask after drafts 0..i-1; rows after the
  first draft the grammar rejects copy the mask at the rejection; the grammar's state is the
  same after the fill as before (`speculative.fill_draft_rows`).
- `speculative.valid_draft_prefix(grammar, drafts)`: the longest prefix of the drafts the
  grammar allows ([a, b, c] with b invalid → [a]); `-1` padding is stripped first; the state
  is unchanged.
- `Grammar.accept_tokens(verified)` (all or nothing) advances by the tokens the target model
  accepted; `Grammar.rollback(n)` undoes the last n accepted tokens.
- Runner side: `bitmask.draft_rows_bitmask(step_mask, req_ids, num_drafts, device)` gives the
  masks in the verification layout (request i's 1 + k_i rows in order, all ones when
  unconstrained), to apply with `bitmask.apply_token_bitmask` to the processed logits.

Modules: `params` (the request's constraint, torch-free), `backend` (the grammar interface),
`xgrammar_backend`, `request_grammar` (one request's compile and grammar), `manager`,
`speculative`, `step_bitmask` (the step contract's type, torch-free), `bitmask` (device ops).
Only `params` and `step_bitmask` are imported here: the API server loads this package and must
not load torch.
"""

from fleetserve.engine.structured_output.params import StructuredOutputsParams
from fleetserve.engine.structured_output.step_bitmask import GrammarBitmask

__all__ = ["GrammarBitmask", "StructuredOutputsParams"]
