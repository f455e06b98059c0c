"""A byte-level BPE tokenizer trained with `tokenizers` (every string round-trips exactly)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS_TOKEN = "<|endoftext|>"


def train_tokenizer(docs: Sequence[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE tokenizer of ``vocab_size`` entries on ``docs``.

    The end-of-text token is id 0. Byte-level pre-tokenization means any text, including
    characters never seen in training, encodes and decodes back unchanged.
    """
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + 2:
        raise ValueError(f"vocab_size must be at least {len(alphabet) + 2} "
                         "(256 bytes + end-of-text + one merge), "
                         f"got {vocab_size}")
    if not any(d.strip() for d in docs):
        raise ValueError("cannot train a tokenizer on an empty corpus")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TOKEN],
                                  initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(docs, trainer=trainer, length=len(docs))
    return tok


def eos_id(tok: Tokenizer) -> int:
    """Id of the end-of-text token."""
    i = tok.token_to_id(EOS_TOKEN)
    if i is None:
        raise ValueError(f"tokenizer has no {EOS_TOKEN} token")
    return i


def save_tokenizer(tok: Tokenizer, out_dir: str | Path) -> None:
    """Write tokenizer.json plus the small config files `transformers` reads beside it."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS_TOKEN, "bos_token": None,
              "unk_token": None, "pad_token": EOS_TOKEN, "model_max_length": 1_000_000,
              "clean_up_tokenization_spaces": False}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
