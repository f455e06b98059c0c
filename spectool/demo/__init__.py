"""The bundled demo model: a small Llama-style target trained on Python source, with its draft layers."""

from __future__ import annotations

from pathlib import Path

_HERE = Path(__file__).resolve().parent


def demo_model() -> Path:
    """Directory of the bundled demo model.

    It holds ``target/`` (Hugging Face format: config.json, model.safetensors,
    tokenizer.json), ``eagle/`` (one EAGLE draft layer), ``multi_layer_eagle/`` (K=4 draft
    layers), ``eagle3/`` where the bundle has it (an EAGLE-3 layer in SpecForge's format), and
    ``prompts.jsonl`` (held-out completion and editing prompts).
    """
    if not (_HERE / "target" / "config.json").is_file():
        raise FileNotFoundError(
            f"the demo model is not in {_HERE}; this install was built without it "
            "(train one with `spectool train-target` and `spectool train-draft`)")
    return _HERE
