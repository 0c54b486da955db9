"""Which decoder layers each pipeline stage holds (pure; no torch)."""

from __future__ import annotations

__all__ = ["parse_layer_partition", "stage_layer_range"]


def parse_layer_partition(text: str | None) -> tuple[int, ...] | None:
    """'3,5' → (3, 5); None or '' → None (an even split).

    Raises:
        ValueError: a part that is not a positive integer (the message names the option).
    """
    if not text:
        return None
    try:
        parts = tuple(int(part) for part in text.split(","))
    except ValueError:
        parts = ()
    if not parts or any(p < 1 for p in parts):
        raise ValueError(
            "pipeline_layer_partition must be positive layer counts per stage, comma-separated "
            f"(e.g. '3,5'), got {text!r}"
        )
    return parts


def stage_layer_range(
    num_layers: int, stage: int, num_stages: int, partition: tuple[int, ...] | None = None
) -> tuple[int, int]:
    """The layers [start, end) of pipeline stage `stage` of `num_stages`.

    Even by default: every stage gets num_layers // num_stages layers, and the remainder goes
    one each to the first stages (the last stage also carries the norm and the LM head).
    `partition` gives each stage's layer count explicitly.

    Raises:
        ValueError: more stages than layers, or a partition whose length is not the number of
            stages or whose sum is not the number of layers.
    """
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage must be in [0, {num_stages}), got {stage}")
    if partition is None:
        if num_stages > num_layers:
            raise ValueError(
                f"pipeline_parallel_size ({num_stages}) must be <= the model's "
                f"num_hidden_layers ({num_layers})"
            )
        base, extra = divmod(num_layers, num_stages)
        counts = [base + (1 if s < extra else 0) for s in range(num_stages)]
    else:
        if len(partition) != num_stages or sum(partition) != num_layers:
            raise ValueError(
                f"pipeline_layer_partition must give {num_stages} stage(s) summing to the "
                f"model's {num_layers} layers, got {list(partition)}"
            )
        counts = list(partition)
    start = sum(counts[:stage])
    return start, start + counts[stage]
