"""Time to first token of JSON-schema requests with a cold and a cached grammar, next to the
same request without a constraint (the baseline), through the offline engine (issue 20, 4).

    PYTHONPATH=. python hack/bench_structured_ttft.py [--model DIR] [--repeats 5] [--fields 400]

Each request asks for one token (so its end is its first token), one at a time. Cold: every
request carries a schema never seen before (another property name), so its grammar compiles
while it waits; cached: the same schema again, whose compiled grammar the manager keeps. Prints
the median and the maximum of each, in milliseconds, side by side.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from fleetserve import LLM, SamplingParams
from fleetserve.engine.structured_output.params import StructuredOutputsParams
from fleetserve.engine.tokenizer import encode_prompt


def schema(fields: int, tag: str) -> dict[str, Any]:
    """An object of `fields` properties (strings with patterns, enums, bounded numbers)."""
    properties: dict[str, Any] = {}
    for i in range(fields):
        kind = i % 3
        if kind == 0:
            properties[f"{tag}_code_{i}"] = {"type": "string", "pattern": "[A-Z]{2}[0-9]{3,6}"}
        elif kind == 1:
            properties[f"{tag}_level_{i}"] = {"enum": ["low", "medium", "high", "critical"]}
        else:
            properties[f"{tag}_ratio_{i}"] = {"type": "number", "minimum": 0, "maximum": 1}
    return {"type": "object", "properties": properties, "required": list(properties)}


def ttft_ms(llm: LLM, prompt: list[int], params: SamplingParams) -> float:
    start = time.perf_counter()
    request_id = llm.add_request(prompt, params)
    while True:
        if any(output.request_id == request_id for output in llm.step()):
            return (time.perf_counter() - start) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="HF model folder (default: bundled)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--fields", type=int, default=400, help="properties per schema")
    args = parser.parse_args()
    model = args.model
    if model is None:
        from fleetserve.engine.models.bundled import bundled_model_path

        model = str(bundled_model_path())
    llm = LLM(model, dtype="float32", max_model_len=512)
    assert llm.tokenizer is not None, "a grammar needs the model's tokenizer"
    prompt = encode_prompt(llm.tokenizer, "Describe the incident as JSON.")

    def constrained(tag: str) -> SamplingParams:
        so = StructuredOutputsParams.create(json=schema(args.fields, tag))
        return SamplingParams(temperature=0, max_tokens=1, structured_outputs=so)

    plain = SamplingParams(temperature=0, max_tokens=1)
    ttft_ms(llm, prompt, constrained("warmup"))  # builds the backend (import + vocabulary)
    ttft_ms(llm, prompt, plain)
    rows = {
        "no grammar (baseline)": [ttft_ms(llm, prompt, plain) for _ in range(args.repeats)],
        "cold grammar": [ttft_ms(llm, prompt, constrained(f"c{i}")) for i in range(args.repeats)],
        "cached grammar": [ttft_ms(llm, prompt, constrained("c0")) for _ in range(args.repeats)],
    }
    print(f"TTFT, {args.repeats} requests each, schema of {args.fields} properties, {model}")
    print(f"{'':24s}{'median ms':>12s}{'max ms':>10s}")
    for name, values in rows.items():
        print(f"{name:24s}{statistics.median(values):12.1f}{max(values):10.1f}")
    manager = llm.engine_core.scheduler.structured_output.manager
    assert manager is not None
    print(f"grammar compiles: {manager.num_compiles}, cache hits: {manager.num_cache_hits}")


if __name__ == "__main__":
    main()
