"""Constrained generation through the real engine on a tiny random-weight model: the mask holds
with chunked prefill, prefix caching and preemption; a compiling grammar blocks nobody; a bad
grammar fails only its own request (seed notes part 2 §4, scenario 3)."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import pytest

from fleetserve import LLM, SamplingParams
from fleetserve.common.error_codes import INVALID_GRAMMAR
from fleetserve.engine.core.engine_core import EngineCore
from fleetserve.engine.request import RequestStatus
from fleetserve.engine.structured_output.backend import CompiledGrammar, GrammarBackend
from fleetserve.engine.structured_output.factory import create_manager
from fleetserve.engine.structured_output.params import StructuredOutputsParams
from tests.engine.tiny_models import make_tiny_model

REGEX = r"[a-d]{3,8}x"
CHOICES = ["alpha", "beta", "gamma delta"]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("llama"), "llama")


def constrained(**params: object) -> StructuredOutputsParams:
    return StructuredOutputsParams.create(**params)  # type: ignore[arg-type]


def prompts(num: int, length: int) -> list[str]:
    """ASCII prompts (one token per character with the tiny tokenizer), of distinct lengths."""
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex it "
    return [(words * 8)[i : i + length + i] for i in range(num)]


@pytest.mark.parametrize(
    "setting",
    [
        {},
        {"max_num_batched_tokens": 16, "long_prefill_token_threshold": 8},
        {"num_kv_blocks": 12, "block_size": 16, "max_num_batched_tokens": 64},
    ],
    ids=["defaults", "chunked", "preempt"],
)
def test_outputs_follow_the_regex_and_the_choice(tiny_llama: Path, setting: dict) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", max_model_len=256, **setting)
    batch = prompts(8, 40)
    by_regex = [
        SamplingParams(
            temperature=t, seed=i, max_tokens=20, structured_outputs=constrained(regex=REGEX)
        )
        for i, t in enumerate([0.0, 1.0] * 4)
    ]
    outputs = llm.generate(batch, by_regex)
    for output in outputs:
        assert re.fullmatch(REGEX, output.outputs[0].text), output.outputs[0].text
        assert output.outputs[0].finish_reason == "stop"
    by_choice = SamplingParams(temperature=1.0, seed=3, max_tokens=20,
                               structured_outputs=constrained(choice=CHOICES))  # fmt: skip
    for output in llm.generate(batch, by_choice):
        assert output.outputs[0].text in CHOICES
    # the same prompts again: prefix-cache hits, the grammar still applies from the first token
    again = llm.generate(batch, by_regex)
    assert [o.outputs[0].text for o in again] == [o.outputs[0].text for o in outputs]
    if "num_kv_blocks" in setting:
        assert llm.engine_core.make_stats().num_preemptions > 0
    else:  # (a cache of 12 blocks keeps nothing between the rounds)
        assert sum(o.num_cached_tokens for o in again) > 0


def test_an_unconstrained_request_next_to_constrained_ones_is_unchanged(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", max_model_len=256)
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = llm.generate(prompts(1, 20), plain)[0].outputs[0].token_ids
    mixed = llm.generate(
        prompts(3, 20)[:1] * 3,
        [plain, SamplingParams(temperature=0, max_tokens=12, structured_outputs=constrained(regex=REGEX)),
         SamplingParams(temperature=0, max_tokens=12, structured_outputs=constrained(choice=CHOICES))],
    )  # fmt: skip
    assert mixed[0].outputs[0].token_ids == alone


class GatedBackend(GrammarBackend):
    """The real backend, whose compiles wait for `gate` (a compile as slow as the test wants)."""

    def __init__(self, inner: GrammarBackend, gate: threading.Event) -> None:
        self.inner, self.gate, self.name = inner, gate, inner.name

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        assert self.gate.wait(60), "the test never opened the gate"
        return self.inner.compile(params)

    def new_grammar(self, compiled: CompiledGrammar):
        return self.inner.new_grammar(compiled)

    @property
    def vocab_size(self) -> int:
        return self.inner.vocab_size


def test_a_compiling_grammar_blocks_nobody_and_a_bad_one_fails_alone(tiny_llama: Path) -> None:
    core = EngineCore(LLM(str(tiny_llama), dtype="float32", max_model_len=128).config)
    gate = threading.Event()
    real = create_manager(core.config)
    manager = type(real)(lambda: GatedBackend(real._backend_factory(), gate))
    core.scheduler.structured_output.manager = manager
    eos = (2,)
    core.add_request(
        "slow",
        [5, 6, 7],
        SamplingParams(temperature=0, max_tokens=10, structured_outputs=constrained(regex=REGEX)),
        eos_token_ids=eos,
    )
    core.add_request(
        "bad",
        [5, 6, 7],
        SamplingParams(
            temperature=0, max_tokens=10, structured_outputs=constrained(grammar='root ::= "a" | ')
        ),
        eos_token_ids=eos,
    )
    core.add_request("plain", [5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                     eos_token_ids=eos)  # fmt: skip
    outputs = {}
    while "plain" not in outputs or not outputs["plain"][-1].finished:
        for out in core.step():
            outputs.setdefault(out.req_id, []).append(out)
        core.scheduler.check_invariants()
    assert len([t for o in outputs["plain"] for t in o.new_token_ids]) == 4
    assert "slow" not in outputs and "bad" not in outputs
    assert core.scheduler.requests["slow"].status == RequestStatus.WAITING_FOR_GRAMMAR
    assert core.make_stats().num_waiting_reqs == 2
    gate.set()
    while core.has_unfinished_requests():
        for out in core.step():
            outputs.setdefault(out.req_id, []).append(out)
        core.scheduler.check_invariants()
    (bad,) = outputs["bad"]
    assert bad.finish_reason == "abort" and bad.error is not None
    assert bad.error.startswith(f"{INVALID_GRAMMAR}: structured_outputs.grammar does not compile")
    assert outputs["slow"][-1].finish_reason == "stop" and outputs["slow"][-1].error is None
    core.shutdown()


def test_abort_while_the_grammar_compiles(tiny_llama: Path) -> None:
    core = EngineCore(LLM(str(tiny_llama), dtype="float32", max_model_len=128).config)
    params = SamplingParams(max_tokens=4, structured_outputs=constrained(regex="[0-9]{1,400}"))
    core.add_request("r", [5, 6, 7], params, eos_token_ids=(2,))
    core.abort_requests(["r"])
    core.scheduler.check_invariants()
    assert not core.has_unfinished_requests()
    core.shutdown()


def test_the_llguidance_backend_constrains_the_engine_too(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", max_model_len=256)
    manager = create_manager(llm.config, backend="llguidance")
    llm.engine_core.scheduler.structured_output.manager = manager
    regex = SamplingParams(temperature=1.0, seed=5, max_tokens=20,
                           structured_outputs=constrained(regex=REGEX))  # fmt: skip
    for output in llm.generate(prompts(4, 30), regex):
        assert re.fullmatch(REGEX, output.outputs[0].text), output.outputs[0].text
    choice = SamplingParams(temperature=1.0, seed=6, max_tokens=20,
                            structured_outputs=constrained(choice=CHOICES))  # fmt: skip
    for output in llm.generate(prompts(4, 30), choice):
        assert output.outputs[0].text in CHOICES
    assert manager.backend is not None and manager.backend.name == "llguidance"


def test_an_unknown_backend_is_refused_by_name(tiny_llama: Path) -> None:
    config = LLM(str(tiny_llama), dtype="float32", max_model_len=64).config
    with pytest.raises(ValueError, match="structured output backend must be one of"):
        create_manager(config, backend="outlines")


def test_n_sequences_share_one_compile_and_each_follows_the_grammar(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", max_model_len=256)
    params = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=20,
                            structured_outputs=constrained(regex=r"[e-h]{2,6}z"))  # fmt: skip
    (output,) = llm.generate(prompts(1, 25), params)
    assert len(output.outputs) == 4
    for completion in output.outputs:
        assert re.fullmatch(r"[e-h]{2,6}z", completion.text), completion.text
    manager = llm.engine_core.scheduler.structured_output.manager
    assert manager is not None and manager.num_compiles == 1


def test_an_extreme_penalty_never_draws_a_masked_token(tiny_llama: Path) -> None:
    # Found by the HTTP fuzzer: repetition_penalty=5e-324 overflowed the logits of repeated
    # tokens to +inf, the softmax went NaN and the draw picked token 0, which the grammar had
    # masked: the request failed as an engine error (500).
    llm = LLM(str(tiny_llama), dtype="float32", max_model_len=256)
    params = [
        SamplingParams(
            temperature=t,
            seed=i,
            max_tokens=20,
            repetition_penalty=5e-324,
            structured_outputs=constrained(regex=REGEX),
        )
        for i, t in enumerate([1.0, 0.0, 1.0, 1.0])
    ]
    for output in llm.generate(prompts(4, 30), params):
        assert re.fullmatch(REGEX, output.outputs[0].text), output.outputs[0].text
