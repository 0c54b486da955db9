"""Executors drive the workers; `UniProcExecutor` runs the single rank in this process."""

from __future__ import annotations

from fleetserve.engine.config import EngineConfig
from fleetserve.engine.core.outputs import ModelRunnerOutput, SchedulerOutput
from fleetserve.engine.worker.model_runner import ModelRunner


class UniProcExecutor:
    """One model runner, called directly (no RPC); the EngineCore's view of the workers.

    Lifecycle: `initialize()` once (load, size and allocate the KV cache, capture CUDA graphs),
    then
    `execute_model(so)` per step, then `shutdown()`.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.runner = ModelRunner(config)

    def initialize(self) -> int:
        """Load the model and allocate the KV cache; returns the number of KV blocks (incl. 0)."""
        self.runner.load_model()
        num_blocks = self.runner.determine_num_kv_blocks()
        self.runner.initialize_kv_cache(num_blocks)
        self.runner.capture_cuda_graphs()
        return num_blocks

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(scheduler_output)

    def shutdown(self) -> None:
        """Release the model and the KV cache (the process may keep running)."""
        if self.runner.decode_graphs is not None:
            self.runner.decode_graphs.clear()
            self.runner.decode_graphs = None
        self.runner.model = None
        self.runner.kv_caches = []
