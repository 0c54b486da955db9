"""`OutputProcessor`: the one owner of n > 1 bookkeeping (children ↔ parent, which children
still wait, gathering), driven with hand-built core outputs on the bundled tokenizer."""

from __future__ import annotations

from typing import Any

import pytest

from fleetserve.engine.core.outputs import EngineCoreOutput, LogprobsLists
from fleetserve.engine.output_processor import OutputKind, OutputProcessor, child_request_id
from fleetserve.engine.sampling_params import SamplingParams
from fleetserve.engine.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from fleetserve.engine.models.bundled import bundled_model_path

    return load_tokenizer(bundled_model_path())


def test_children_map_to_their_parent_and_leave_with_it(tokenizer: Any) -> None:
    processor = OutputProcessor(tokenizer)
    children = processor.add_request("r", None, [1, 2], SamplingParams(n=3, seed=5))
    assert list(children) == [child_request_id("r", i) for i in range(3)] == ["0_r", "1_r", "2_r"]
    assert [p.seed for p in children.values()] == [5, 6, 7]
    assert all(p.n == 1 for p in children.values())
    assert [processor.parent_id_of(c) for c in children] == ["r"] * 3
    assert processor.child_ids("r") == list(children)
    single = processor.add_request("s", None, [1], SamplingParams())
    assert list(single) == ["s"] and processor.parent_id_of("s") == "s"
    with pytest.raises(ValueError, match="request_id 'r' is already in use"):
        processor.add_request("r", None, [1], SamplingParams())
    assert processor.abort_request("r") == list(children)
    assert processor.parent_id_of("0_r") is None and processor.child_ids("r") == []
    assert processor.abort_request("r") == []


def test_waiting_sequences_are_counted_until_scheduled_or_gone(tokenizer: Any) -> None:
    processor = OutputProcessor(tokenizer)
    processor.add_request("a", None, [1], SamplingParams(n=2))
    processor.add_request("b", None, [1], SamplingParams())
    assert processor.num_unscheduled == 3
    # The first scheduled child of a parent ends the parent's queue time; later ones do not.
    assert processor.record_scheduled("1_a") == "a"
    assert processor.record_scheduled("1_a") is None  # reported twice: counted once
    assert processor.num_unscheduled == 2
    assert processor.record_scheduled("0_a") is None
    assert processor.record_scheduled("unknown") is None
    assert processor.num_unscheduled == 1
    processor.abort_request("b")  # never scheduled: it stops waiting when it goes
    assert processor.num_unscheduled == 0
    processor.add_request("c", None, [1], SamplingParams(n=2, max_tokens=1))
    processor.record_scheduled("0_c")
    processed = processor.process_outputs(
        [EngineCoreOutput("0_c", [7], finish_reason="length"),
         EngineCoreOutput("1_c", [8], finish_reason="length")]
    )  # fmt: skip
    assert [o.finished for o in processed.request_outputs] == [True]
    assert processor.num_unscheduled == 0 and not processor.has_request("c")


def test_children_are_gathered_into_one_output_per_parent(tokenizer: Any) -> None:
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", "p", [1], SamplingParams(n=2), kind=OutputKind.DELTA)
    hello, world = tokenizer.encode("Hello"), tokenizer.encode(" world")
    first = processor.process_outputs(
        [EngineCoreOutput("0_r", hello, num_cached_tokens=16), EngineCoreOutput("1_r", world)]
    )
    (output,) = first.request_outputs
    assert (output.request_id, output.prompt, output.num_cached_tokens) == ("r", "p", 16)
    assert [(c.index, c.token_ids, c.finished) for c in output.outputs] == [
        (0, hello, False),
        (1, world, False),
    ]
    last = processor.process_outputs([EngineCoreOutput("0_r", [2], finish_reason="stop")])
    (output,) = last.request_outputs
    assert [(c.index, c.token_ids, c.finish_reason) for c in output.outputs] == [
        (0, [2], "stop"),
        (1, [], None),
    ]
    assert not output.finished
    # Outputs of children the caller aborted meanwhile are dropped.
    processor.abort_request("r")
    assert processor.process_outputs([EngineCoreOutput("1_r", [5])]).request_outputs == []


def test_a_stop_string_finishes_the_child_in_the_core(tokenizer: Any) -> None:
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", None, [1], SamplingParams(n=2, stop=["world"]))
    processed = processor.process_outputs(
        [EngineCoreOutput("0_r", tokenizer.encode("Hello world")),
         EngineCoreOutput("1_r", tokenizer.encode("Hi"))]
    )  # fmt: skip
    assert processed.reqs_to_finish == ["0_r"]
    assert processed.request_outputs == []  # FINAL mode: only when every child finished


def test_logprob_rows_become_entries_and_a_cumulative_sum(tokenizer: Any) -> None:
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", None, [1, 2, 3], SamplingParams(logprobs=1, prompt_logprobs=1))
    rows = LogprobsLists([[7, 7], [9, 4]], [[-0.5, -0.5], [-2.0, -0.1]], [1, 3])
    prompt_rows = LogprobsLists([[2, 5], [3, 3]], [[-1.0, -0.2], [-0.3, -0.3]], [2, 1])
    processed = processor.process_outputs(
        [EngineCoreOutput("r", [7, 9], rows, prompt_rows, finish_reason="length")]
    )
    (output,) = processed.request_outputs
    completion = output.outputs[0]
    assert completion.cumulative_logprob == pytest.approx(-2.5)
    assert completion.logprobs is not None
    assert [{t: (lp.logprob, lp.rank) for t, lp in e.items()} for e in completion.logprobs] == [
        {7: (-0.5, 1)},  # the sampled token is also the top-1: one entry
        {9: (-2.0, 3), 4: (-0.1, 1)},
    ]
    assert completion.logprobs[1][4].decoded_token == str(tokenizer.decode([4]))
    assert output.prompt_logprobs is not None and output.prompt_logprobs[0] is None
    assert [{t: lp.rank for t, lp in e.items()} for e in output.prompt_logprobs[1:] if e] == [
        {2: 2, 5: 1},
        {3: 1},
    ]


# -- failures of one request (issue 13) --------------------------------------------------------


def test_an_error_from_the_core_fails_the_parent_and_aborts_its_siblings(tokenizer: Any) -> None:
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", None, [1], SamplingParams(n=2), kind=OutputKind.DELTA)
    processor.add_request("s", None, [1], SamplingParams(), kind=OutputKind.DELTA)
    processed = processor.process_outputs(
        [EngineCoreOutput("0_r", [], finish_reason="abort", error="RuntimeError: boom"),
         EngineCoreOutput("s", [7])]
    )  # fmt: skip
    assert processed.failed == {"r": "RuntimeError: boom"}
    assert processed.reqs_to_abort == ["1_r"]  # the failed child is finished in the core already
    # The failed request is forgotten and never completes normally; the other one goes on.
    assert not processor.has_request("r") and processor.parent_id_of("1_r") is None
    assert [o.request_id for o in processed.request_outputs] == ["s"]
    assert processor.process_outputs([EngineCoreOutput("1_r", [5])]).request_outputs == []


def test_a_failure_processing_one_output_fails_only_its_request(tokenizer: Any) -> None:
    processor = OutputProcessor(tokenizer)
    processor.add_request("bad", None, [1], SamplingParams(logprobs=1), kind=OutputKind.DELTA)
    processor.add_request("good", None, [1], SamplingParams(), kind=OutputKind.DELTA)
    malformed = LogprobsLists([[7, 8]], [[-0.5]], [1])  # ids and values disagree in length
    processed = processor.process_outputs(
        [EngineCoreOutput("bad", [7], malformed), EngineCoreOutput("good", [7])]
    )
    assert list(processed.failed) == ["bad"] and "ValueError" in processed.failed["bad"]
    assert processed.reqs_to_abort == ["bad"]
    assert [o.request_id for o in processed.request_outputs] == ["good"]
    assert not processor.has_request("bad") and processor.has_request("good")
