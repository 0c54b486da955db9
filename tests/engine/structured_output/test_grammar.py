"""The seed's structured-output scenarios (notes part 2 §4, 1–2) on each real backend (xgrammar,
llguidance): bitmask layout, parallel fill = sequential fill, draft rows, rollback, longest valid
prefix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import xgrammar as xgr

from fleetserve.engine.structured_output.backend import Grammar, GrammarCompileError
from fleetserve.engine.structured_output.bitmask import (
    apply_token_bitmask,
    batch_bitmask,
    unpack_bitmask,
)
from fleetserve.engine.structured_output.manager import StructuredOutputManager
from fleetserve.engine.structured_output.params import StructuredOutputsParams
from fleetserve.engine.structured_output.speculative import fill_draft_rows, valid_draft_prefix
from fleetserve.engine.structured_output.step_bitmask import bitmask_width
from tests.engine.structured_output.grammar_fixtures import EOS, VOCAB_SIZE, ids, tiny_manager

WIDTH = bitmask_width(VOCAB_SIZE)
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
    "required": ["name", "n"],
}


@pytest.fixture(scope="module", params=["xgrammar", "llguidance"])
def manager_and_tokenizer(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    manager, tokenizer = tiny_manager(tmp_path_factory.mktemp("tok"), request.param, max_workers=2)
    yield manager, tokenizer
    manager.shutdown()


def grammar_of(manager: StructuredOutputManager, **params) -> Grammar:
    request_grammar = manager.init_request(StructuredOutputsParams.create(**params))
    request_grammar.future.result(timeout=60)
    assert request_grammar.resolve(), request_grammar.error
    assert request_grammar.grammar is not None
    return request_grammar.grammar


def mask_of(grammar: Grammar) -> torch.Tensor:
    bitmask = torch.zeros(1, WIDTH, dtype=torch.int32)
    grammar.fill_bitmask(bitmask, 0)
    return bitmask[0].clone()


def allowed(mask: torch.Tensor) -> set[int]:
    return set(unpack_bitmask(mask.unsqueeze(0), VOCAB_SIZE)[0].nonzero().flatten().tolist())


def test_bitmask_layout_one_bit_per_token_set_means_allowed(manager_and_tokenizer) -> None:
    manager, tokenizer = manager_and_tokenizer
    grammar = grammar_of(manager, choice=["a", "b"])
    mask = mask_of(grammar)
    assert mask.dtype == torch.int32 and mask.shape == (WIDTH,)
    token_a, token_b = ids(tokenizer, "a")[0], ids(tokenizer, "b")[0]
    assert allowed(mask) == {token_a, token_b}
    # token t is bit t % 32 of word t // 32
    for token in (token_a, token_b):
        assert (int(mask[token // 32]) >> (token % 32)) & 1 == 1
    assert grammar.accept_tokens([token_a])
    assert allowed(mask_of(grammar)) == {EOS}


def test_unconstrained_rows_are_all_ones_and_leave_logits_unchanged(manager_and_tokenizer) -> None:
    manager, tokenizer = manager_and_tokenizer
    grammar = grammar_of(manager, regex="[0-9]+")
    step_mask = manager.grammar_bitmask([("constrained", grammar)])
    assert step_mask is not None and step_mask.row_of == {"constrained": 0}
    rows = batch_bitmask(step_mask, ["free", "constrained"], torch.device("cpu"))
    assert rows is not None
    assert torch.equal(rows[0], torch.full((WIDTH,), -1, dtype=torch.int32))
    logits = torch.randn(2, VOCAB_SIZE)
    masked = logits.clone()
    apply_token_bitmask(masked, rows)
    assert torch.equal(masked[0], logits[0])
    digits = set(ids(tokenizer, "0123456789"))
    assert set(torch.isfinite(masked[1]).nonzero().flatten().tolist()) == digits
    # the same as xgrammar's own kernel
    reference = logits.clone()
    xgr.apply_token_bitmask_inplace(reference, rows)
    assert torch.equal(masked, reference)
    assert batch_bitmask(step_mask, ["free"], torch.device("cpu")) is None


def test_apply_token_bitmask_refuses_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match="bitmask must be"):
        apply_token_bitmask(torch.zeros(2, VOCAB_SIZE), torch.zeros(1, WIDTH, dtype=torch.int32))


def test_parallel_fill_of_200_rows_is_bit_identical_to_sequential(manager_and_tokenizer) -> None:
    manager, tokenizer = manager_and_tokenizer
    text = json.dumps({"name": "abcdefghij", "n": 1234567})
    grammars = []
    for i in range(200):
        grammar = grammar_of(manager, json=SCHEMA)
        assert grammar.accept_tokens(ids(tokenizer, text[: i % len(text)]))
        grammars.append(grammar)
    sequential = torch.zeros(200, WIDTH, dtype=torch.int32)
    for row, grammar in enumerate(grammars):
        grammar.fill_bitmask(sequential, row)
    parallel = torch.zeros(200, WIDTH, dtype=torch.int32)
    manager.fill_parallel(grammars, parallel)
    assert torch.equal(parallel, sequential)
    step_mask = manager.grammar_bitmask([(f"r{i}", g) for i, g in enumerate(grammars)])
    assert step_mask is not None
    assert (step_mask.bitmask == sequential.numpy()).all()
    assert len({tuple(row.tolist()) for row in sequential}) > 10  # the states really differ


def test_three_drafts_second_invalid(manager_and_tokenizer) -> None:
    manager, tokenizer = manager_and_tokenizer
    grammar = grammar_of(manager, regex="[a-c]+x")
    d0, d1, d2 = ids(tokenizer, "a")[0], ids(tokenizer, "z")[0], ids(tokenizer, "b")[0]
    before = mask_of(grammar)
    bitmask = torch.zeros(4, WIDTH, dtype=torch.int32)
    assert fill_draft_rows(grammar, [d0, d1, d2], bitmask, 0) == 4
    assert torch.equal(bitmask[0], before)
    after_d0 = bitmask[1].clone()
    assert allowed(after_d0) == set(ids(tokenizer, "abcx"))
    assert torch.equal(bitmask[2], after_d0) and torch.equal(bitmask[3], after_d0)
    assert torch.equal(mask_of(grammar), before)  # state after the fill = state before
    assert grammar.num_accepted_tokens == 0
    assert valid_draft_prefix(grammar, [d0, d1, d2]) == [d0]
    assert torch.equal(mask_of(grammar), before)


def test_draft_rows_when_every_draft_is_valid(manager_and_tokenizer) -> None:
    manager, tokenizer = manager_and_tokenizer
    grammar = grammar_of(manager, choice=["abc"])
    drafts = ids(tokenizer, "abc")
    step_mask = manager.grammar_bitmask([("r", grammar)], draft_token_ids={"r": drafts})
    assert step_mask is not None and step_mask.num_rows == {"r": 4}
    expected = [set(ids(tokenizer, "a")), set(ids(tokenizer, "b")), set(ids(tokenizer, "c")), {EOS}]
    assert [allowed(torch.from_numpy(row)) for row in step_mask.bitmask] == expected
    assert grammar.num_accepted_tokens == 0


def test_padding_never_reaches_the_grammar(manager_and_tokenizer) -> None:
    manager, tokenizer = manager_and_tokenizer
    grammar = grammar_of(manager, regex="[a-c]+")
    d0 = ids(tokenizer, "a")[0]
    assert valid_draft_prefix(grammar, [d0, -1, -1]) == [d0]
    bitmask = torch.zeros(3, WIDTH, dtype=torch.int32)
    fill_draft_rows(grammar, [d0, -1], bitmask, 0)
    assert torch.equal(bitmask[2], bitmask[1])
    assert grammar.num_accepted_tokens == 0


def test_rollback_restores_the_state_and_accept_is_all_or_nothing(manager_and_tokenizer) -> None:
    manager, tokenizer = manager_and_tokenizer
    grammar = grammar_of(manager, json=SCHEMA)
    assert grammar.accept_tokens(ids(tokenizer, '{"name": "x'))
    before = mask_of(grammar)
    accepted = grammar.num_accepted_tokens
    assert grammar.accept_tokens(ids(tokenizer, 'yz", "n": 4'))
    grammar.rollback(grammar.num_accepted_tokens - accepted)
    assert torch.equal(mask_of(grammar), before)
    assert not grammar.accept_tokens(ids(tokenizer, 'y", "oops": '))  # valid start, bad key
    assert grammar.num_accepted_tokens == accepted
    assert torch.equal(mask_of(grammar), before)
    with pytest.raises(ValueError, match="num_tokens must be in"):
        grammar.rollback(accepted + 1)


def test_terminated_grammar_leaves_the_row_unconstrained(manager_and_tokenizer) -> None:
    manager, tokenizer = manager_and_tokenizer
    grammar = grammar_of(manager, choice=["ok"])
    assert grammar.validate_tokens([*ids(tokenizer, "ok"), EOS, EOS]) == [
        *ids(tokenizer, "ok"),
        EOS,
    ]
    assert grammar.accept_tokens([*ids(tokenizer, "ok"), EOS])
    assert grammar.is_terminated()
    assert torch.equal(mask_of(grammar), torch.full((WIDTH,), -1, dtype=torch.int32))
    assert not grammar.accept_tokens(ids(tokenizer, "o"))
    grammar.rollback(1)  # the stop token itself
    assert not grammar.is_terminated() and allowed(mask_of(grammar)) == {EOS}
    grammar.rollback(2)
    assert allowed(mask_of(grammar)) == set(ids(tokenizer, "o"))


def test_compiled_grammars_are_cached_by_the_constraint(tmp_path: Path) -> None:
    manager, _ = tiny_manager(tmp_path, max_cached_grammars=2)
    try:
        first = manager.init_request(StructuredOutputsParams.create(json=SCHEMA))
        first.future.result(timeout=60)
        # the same schema, given as text this time, is the same constraint
        again = manager.init_request(
            StructuredOutputsParams.create(json=json.dumps(SCHEMA, separators=(",", ":")))
        )
        assert again.is_compiled and manager.num_compiles == 1 and manager.num_cache_hits == 1
        for regex in ("a+", "b+", "c+"):
            manager.init_request(StructuredOutputsParams.create(regex=regex)).future.result(60)
        assert manager.num_cached_grammars == 2  # bounded: the schema was evicted
        assert not manager.init_request(StructuredOutputsParams.create(json=SCHEMA)).is_compiled
    finally:
        manager.shutdown()


def test_no_backend_is_built_before_the_first_structured_request(tmp_path: Path) -> None:
    built = []

    def factory():
        built.append(1)
        return tiny_manager(tmp_path)[0]._backend_factory()

    manager = StructuredOutputManager(factory)
    assert manager.backend is None and not built
    manager.init_request(StructuredOutputsParams.create(regex="a")).future.result(60)
    assert built == [1] and manager.backend is not None
    manager.shutdown()


def test_a_constraint_that_does_not_compile_fails_with_its_reason(manager_and_tokenizer) -> None:
    manager, _ = manager_and_tokenizer
    request_grammar = manager.init_request(StructuredOutputsParams.create(grammar='root ::= ( "a"'))
    with pytest.raises(GrammarCompileError, match=r"structured_outputs\.grammar does not compile"):
        request_grammar.future.result(timeout=60)
    assert not request_grammar.resolve()
    assert request_grammar.is_invalid and request_grammar.error


def test_the_scheduler_side_gives_drafted_requests_one_row_per_draft_plus_one(
    manager_and_tokenizer,
) -> None:
    from fleetserve.engine.structured_output.request_grammar import RequestGrammar
    from fleetserve.engine.structured_output.scheduling import StructuredOutputScheduling
    from tests.factories import make_request

    manager, tokenizer = manager_and_tokenizer
    scheduling = StructuredOutputScheduling(manager)
    requests = []
    for req_id in ("a", "b"):
        request = make_request(req_id, [5, 6, 7], structured_outputs={"regex": "[a-c]+x"})
        so = manager.init_request(request.sampling_params.structured_outputs)
        so.future.result(60)
        assert so.resolve()
        request.structured_output = so
        request.num_computed_tokens = 3  # decoding: its next token is sampled this step
        requests.append(request)
    drafts = {"a": ids(tokenizer, "ab") + ids(tokenizer, "!")}
    assert scheduling.valid_drafts(requests[0], drafts["a"]) == ids(tokenizer, "ab")
    step_mask = scheduling.bitmask(requests, {"a": 1 + 3, "b": 1}, drafts)
    assert step_mask is not None
    assert step_mask.row_of == {"a": 0, "b": 4} and step_mask.num_rows == {"a": 4, "b": 1}
    assert step_mask.bitmask.shape == (5, WIDTH)
    assert isinstance(requests[1].structured_output, RequestGrammar)
    assert requests[0].structured_output.grammar.num_accepted_tokens == 0


def test_draft_rows_come_out_in_the_verification_layout(manager_and_tokenizer) -> None:
    from fleetserve.engine.structured_output.bitmask import draft_rows_bitmask

    manager, tokenizer = manager_and_tokenizer
    grammar = grammar_of(manager, choice=["abc"])
    drafts = ids(tokenizer, "ab")
    step_mask = manager.grammar_bitmask([("g", grammar)], draft_token_ids={"g": drafts})
    cpu = torch.device("cpu")
    rows = draft_rows_bitmask(step_mask, ["free", "g"], [1, 2], cpu)
    assert rows is not None and rows.shape == (2 + 3, WIDTH)
    assert torch.equal(rows[:2], torch.full((2, WIDTH), -1, dtype=torch.int32))
    assert [allowed(row) for row in rows[2:]] == [set(ids(tokenizer, c)) for c in "abc"]
    assert draft_rows_bitmask(step_mask, ["free"], [3], cpu) is None
    with pytest.raises(ValueError, match="rows must be drafts \\+ 1"):
        draft_rows_bitmask(step_mask, ["g"], [1], cpu)
