"""A stand-in for the bundled demo model, for tests that must run before (or without) it.

``make_demo_dir(root)`` writes the same layout as ``st.demo_model()``: target/ (a tiny
random Llama in Hugging Face format with a byte-level BPE tokenizer.json trained on a
few standard-library modules), eagle/ and multi_layer_eagle/ (random draft layers) and
prompts.jsonl (completion and editing prompts). ``demo_or_stand_in`` gives the real
demo model when it is bundled and this stand-in otherwise.
"""

from __future__ import annotations

import json
import textwrap as _textwrap
from pathlib import Path

import pytest

VOCAB_SIZE = 384
HIDDEN = 64
# Standard-library sources the stand-in tokenizer learns from and the prompts are cut from.
_SOURCES = [Path(_textwrap.__file__), Path(json.__file__).with_name("decoder.py")]


def _train_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator((p.read_text() for p in _SOURCES), trainer=trainer)
    tok.save(str(out / "tokenizer.json"))


def _write_target(out: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out.mkdir(parents=True)
    _train_tokenizer(out)
    config = LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=4096, bos_token_id=0, eos_token_id=0,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)


def _write_drafts(root: Path) -> None:
    """Random draft layers in spectool's checkpoint format (INTERNALS.md, "Draft layer")."""
    import torch

    from spectool.model.config import ModelConfig
    from spectool.model.draft_layer import DraftModel, save_draft

    cfg = ModelConfig.from_json(root / "target" / "config.json")
    torch.manual_seed(1)
    for kind, layers in (("eagle", 1), ("multi_layer_eagle", 4)):
        save_draft(DraftModel(cfg, layers, kind), root / kind)


def _write_prompts(root: Path) -> None:
    text = _SOURCES[0].read_text()
    lines = []
    for start in (2000, 6000, 10000):
        lines.append({"kind": "completion", "prompt": text[start:start + 300]})
    for start in (3000, 8000):
        chunk = text[start:start + 400]
        prompt = chunk + "\n\n# the same, lightly changed:\n" + chunk[:120]
        lines.append({"kind": "editing", "prompt": prompt})
    (root / "prompts.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


def make_demo_dir(root: Path) -> Path:
    """Write a stand-in demo model directory under ``root``; returns ``root``."""
    _write_target(root / "target")
    _write_drafts(root)
    _write_prompts(root)
    return root


_stand_in: Path | None = None


def demo_or_stand_in(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled demo model if there is one, else a stand-in with the same layout.

    Test files wrap this in a session fixture named ``demo_model_dir``.
    """
    import spectool as st

    global _stand_in
    try:
        return st.demo_model()
    except FileNotFoundError:
        # Built once per test session, however many test files ask for it.
        if _stand_in is None:
            _stand_in = make_demo_dir(tmp_path_factory.mktemp("demo_model"))
        return _stand_in
