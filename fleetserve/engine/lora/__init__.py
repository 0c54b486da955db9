"""Multi-LoRA serving: adapters in the PEFT folder format, served beside the base model.

Torch-free here (the API process imports `request`, `config`, `peft_config` and `registry`);
the worker side (`weights`, `manager`, `layers`, `ops`, `runner`) imports torch and is loaded
only by the model runner. See `docs/lora.md` for a request's path through the engine.
"""
