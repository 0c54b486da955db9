"""LoRA's small rules: the block hash key, the scheduler's max_loras, the engine arguments and
the adapter config checks."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from fleetserve.common.block_hash import hash_block_tokens, hash_token_blocks
from fleetserve.engine.arg_utils import EngineArgs
from fleetserve.engine.core.kv_cache_utils import get_request_block_hasher
from fleetserve.engine.lora.config import LoRAConfig, LoRAModulePath
from fleetserve.engine.lora.peft_config import PEFTLoRAConfig
from fleetserve.engine.lora.request import LoRARequest
from fleetserve.engine.request import Request, RequestStatus
from fleetserve.engine.sampling_params import SamplingParams
from tests.engine.lora.adapters import TinyLoRAs
from tests.factories import make_scheduler, runner_output

PROMPT = list(range(3, 3 + 40))


def lora_request(req_id: str, lora: LoRARequest | None, prompt: list[int] = PROMPT) -> Request:
    return Request(
        req_id,
        prompt,
        SamplingParams(temperature=0.0, max_tokens=4),
        block_hasher=get_request_block_hasher(16),
        lora_request=lora,
    )


A = LoRARequest("a", 1, "/adapters/a")
B = LoRARequest("b", 2, "/adapters/b")


def test_the_adapter_name_goes_first_into_block_0s_extra_keys() -> None:
    plain = hash_token_blocks(PROMPT, 16)
    under_a = hash_token_blocks(PROMPT, 16, lora_name="a")
    under_b = hash_token_blocks(PROMPT, 16, lora_name="b")
    assert len({*plain, *under_a, *under_b}) == 6, "no block hash shared between them"
    assert under_a[0] == hash_block_tokens(None, PROMPT[:16], ("lora", "a"))
    salted = hash_token_blocks(PROMPT, 16, lora_name="a", cache_salt="t")
    assert salted[0] == hash_block_tokens(None, PROMPT[:16], ("lora", "a", "salt", "t"))
    # Without an adapter the hashes are what they always were (the router computes them too).
    assert hash_token_blocks(PROMPT, 16, cache_salt="t")[0] == hash_block_tokens(
        None, PROMPT[:16], ("salt", "t")
    )


def test_a_requests_block_hashes_carry_its_adapter() -> None:
    assert lora_request("x", A).block_hashes == hash_token_blocks(PROMPT, 16, lora_name="a")
    assert lora_request("y", None).block_hashes == hash_token_blocks(PROMPT, 16)


def test_the_scheduler_admits_at_most_max_loras_adapters_and_the_next_one_waits() -> None:
    scheduler = make_scheduler(num_blocks=40)
    scheduler.max_loras = 1
    for req_id, lora in (("a1", A), ("b1", B), ("a2", A), ("base", None)):
        scheduler.add_request(lora_request(req_id, lora, [7 + len(req_id)] * 20))
    first = scheduler.schedule()
    assert sorted(first.num_scheduled_tokens) == ["a1"], "b1 waits at the head (FCFS)"
    assert [r.request_id for r in scheduler.waiting] == ["b1", "a2", "base"]
    scheduler.update_from_output(first, runner_output(scheduler, first))
    scheduler.finish_requests(["a1"], RequestStatus.FINISHED_ABORTED)
    second = scheduler.schedule()
    assert sorted(second.num_scheduled_tokens) == ["b1"], "a's slot is free: b1 runs"
    assert [r.request_id for r in scheduler.waiting] == ["a2", "base"], "nothing was dropped"


def test_lora_flags_parse_as_vllms() -> None:
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    ns = parser.parse_args(
        ["--enable-lora", "--max-loras", "2", "--max-cpu-loras", "4", "--max-lora-rank", "32",
         "--lora-modules", "a=/x/a", "b=/x/b"]
    )  # fmt: skip
    args = EngineArgs.from_cli_args(ns)
    assert (args.enable_lora, args.max_loras, args.max_cpu_loras, args.max_lora_rank) == (
        True, 2, 4, 32,
    )  # fmt: skip
    assert args.lora_modules == ["a=/x/a", "b=/x/b"]


def test_the_engine_config_holds_the_start_up_adapters(tiny_loras: TinyLoRAs) -> None:
    config = EngineArgs(
        model=str(tiny_loras.base), enable_lora=True, max_loras=2, max_lora_rank=8,
        lora_modules=[f"a={tiny_loras.a}", f"b={tiny_loras.b}"],
    ).create_engine_config()  # fmt: skip
    assert config.lora is not None
    assert config.lora.max_cpu_loras == 2, "defaults to max_loras"
    assert config.lora.lora_modules == (
        LoRAModulePath("a", str(tiny_loras.a)), LoRAModulePath("b", str(tiny_loras.b)),
    )  # fmt: skip
    assert EngineArgs(model=str(tiny_loras.base)).create_engine_config().lora is None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_loras": 2}, "max_loras is a LoRA setting; it needs enable_lora=True"),
        ({"enable_lora": True, "tensor_parallel_size": 2}, "tensor_parallel_size=2 with enable_lora"),
        ({"enable_lora": True, "lora_modules": ["noequals"]}, "name=path"),
        ({"enable_lora": True, "lora_modules": ["x=/nonexistent"]}, "LoRA adapter 'x'.*PEFT folder"),
        ({"enable_lora": True, "speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
         "speculative_config with enable_lora"),
    ],
)  # fmt: skip
def test_bad_lora_arguments_fail_at_start_naming_the_option(
    tiny_loras: TinyLoRAs, kwargs: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        EngineArgs(model=str(tiny_loras.base), **kwargs).create_engine_config()  # type: ignore[arg-type]


def test_a_start_up_adapter_above_max_lora_rank_is_refused(
    tiny_loras: TinyLoRAs, tmp_path: Path
) -> None:
    config = json.loads((tiny_loras.a / "adapter_config.json").read_text())
    (tmp_path / "adapter_config.json").write_text(json.dumps({**config, "r": 16}))
    (tmp_path / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="'big' has rank 16, above max_lora_rank"):
        LoRAConfig(max_lora_rank=8).check_adapter("big", str(tmp_path))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"use_dora": True}, "use_dora=true is not supported"),
        ({"bias": "all"}, "bias must be 'none'"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save is not supported"),
        ({"target_modules": ["embed_tokens"]}, r"target_modules \['embed_tokens'\] are not supported"),
        ({"target_modules": "re:[("}, "target_modules regex"),
        ({"peft_type": "IA3"}, "peft_type must be 'LORA'"),
        ({"r": 0}, "r must be a positive integer"),
    ],
)  # fmt: skip
def test_adapter_configs_the_engine_cannot_serve_are_refused_naming_the_key(
    change: dict[str, object], message: str
) -> None:
    config = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}
    with pytest.raises(ValueError, match=message):
        PEFTLoRAConfig.from_dict({**config, **change})


def test_target_matching_follows_peft_and_rslora_scales_by_the_root() -> None:
    listed = PEFTLoRAConfig.from_dict({"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]})
    assert listed.targets("model.layers.0.self_attn.q_proj")
    assert not listed.targets("model.layers.0.self_attn.k_proj")
    regex = PEFTLoRAConfig.from_dict(
        {"r": 4, "lora_alpha": 8, "use_rslora": True, "target_modules": r".*\.1\..*v_proj"}
    )
    assert regex.targets("model.layers.1.self_attn.v_proj")
    assert not regex.targets("model.layers.0.self_attn.v_proj")
    assert (listed.scaling, regex.scaling) == (2.0, 4.0)


def test_a_lora_request_needs_a_name_and_a_positive_id() -> None:
    with pytest.raises(ValueError, match="lora_int_id must be >= 1"):
        LoRARequest("a", 0, "/x")
    with pytest.raises(ValueError, match="lora_name"):
        LoRARequest("", 1, "/x")


def test_the_benchs_random_adapters_are_servable_peft_folders(
    tiny_loras: TinyLoRAs, tmp_path: Path
) -> None:
    from fleetserve.bench.lora import PROJECTIONS, write_random_adapters
    from fleetserve.engine.lora.weights import LoRAModel

    hf_config = json.loads((tiny_loras.base / "config.json").read_text())
    (folder,) = write_random_adapters(hf_config, tmp_path, count=1, rank=8, seed=0)
    lora = LoRAModel.from_folder(1, str(folder), max_rank=8)
    assert len(lora.weights) == hf_config["num_hidden_layers"] * len(PROJECTIONS)
    assert lora.scaling == 2.0
