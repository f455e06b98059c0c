"""``spectool.load``: a Hugging Face checkpoint (directory or hub id) -> a ready ``Target``."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from spectool.model import parallel
from spectool.model.config import ModelConfig
from spectool.model.llama import Transformer
from spectool.model.parallel import TensorParallel, check_divisible
from spectool.model.rope import RotaryEmbedding
from spectool.model.weights import SafetensorsDir, gather, model_layout
from spectool.threads import pick_cpu_threads

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Target:
    """The target model with its tokenizer and identity (what traces record)."""

    model: Transformer
    config: ModelConfig
    tokenizer: object | None  # tokenizers.Tokenizer
    device: torch.device
    dtype: torch.dtype
    name: str
    model_hash: str
    eos_token_ids: list[int]
    tp: TensorParallel | None = None  # this rank's place when the target is split over processes

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (with the tokenizer's BOS etc. when add_special_tokens)."""
        return self._need_tokenizer().encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of token ids."""
        return self._need_tokenizer().decode(list(ids), skip_special_tokens=skip_special_tokens)

    def _need_tokenizer(self):
        if self.tokenizer is None:
            raise ValueError(f"model {self.name} was loaded without a tokenizer.json; "
                             "pass token ids instead of text")
        return self.tokenizer


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """torch dtype from a dtype or its name ('bfloat16', 'torch.float16', ...)."""
    if isinstance(dtype, str):
        dtype = _DTYPES.get(dtype.removeprefix("torch."), dtype)
    if dtype not in _DTYPES.values():
        raise ValueError(f"dtype must be one of float32, bfloat16, float16; got {dtype!r}")
    return dtype


def resolve_checkpoint(path_or_hub_id: str | Path) -> Path:
    """A local directory as is; anything else is a hub id downloaded by huggingface_hub."""
    path = Path(path_or_hub_id).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise ValueError(f"{path} is a file; pass the checkpoint directory (config.json, *.safetensors)")
    repo_id = str(path_or_hub_id)
    if not _looks_like_hub_id(repo_id):
        raise FileNotFoundError(f"no such directory: {path}")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "tokenizer*"]))
    except HFValidationError as e:
        raise FileNotFoundError(f"no such directory: {path} (nor is it a Hugging Face hub id)") from e
    except RepositoryNotFoundError as e:
        raise ValueError(f"no such directory: {path}, and no Hugging Face hub repository has the id "
                         f"{repo_id!r}") from e
    except (LocalEntryNotFoundError, OSError) as e:
        raise OSError(f"no such directory: {path}; as a Hugging Face hub id it could not be downloaded "
                      f"(offline or no network?): download it elsewhere and pass the directory. "
                      f"Cause: {type(e).__name__}: {e}") from e


def _looks_like_hub_id(text: str) -> bool:
    """'name' or 'owner/name' of letters, digits, '-', '_', '.' (not starting with '.'): anything else,
    such as an absolute, home-relative or deeper path, can only be a directory."""
    parts = text.split("/")
    return 1 <= len(parts) <= 2 and all(
        p and not p.startswith(".") and all(c.isalnum() or c in "-_." for c in p) for p in parts)


def load(path_or_hub_id: str | Path, device: str | torch.device = "cpu",
         dtype: torch.dtype | str = torch.float32, tp_size: int = 1) -> Target:
    """Load a Llama / Mistral / Qwen2 / Qwen3 checkpoint as a :class:`Target`.

    Args:
        path_or_hub_id: a directory with config.json, *.safetensors (one file, or shards
            with model.safetensors.index.json) and optionally tokenizer.json; or a hub id.
        device: where the weights live.
        dtype: float32, bfloat16 or float16 (torch dtype or name).
        tp_size: split the target over this many processes (tensor parallelism; launch them with
            ``torchrun --nproc-per-node N`` or ``spectool record --tp N``). Each rank reads only
            its shard of the weights; on CUDA rank r uses GPU LOCAL_RANK.

    On a CPU the first load also picks torch's thread count for the model unless the user set one
    (``spectool.threads``: one thread for small models).

    Raises:
        ValueError: unsupported architecture, missing config field, missing or misshaped tensor.
        FileNotFoundError: ``path_or_hub_id`` looks like a path and there is no such directory.
    """
    dtype = resolve_dtype(dtype)
    device = torch.device(device)
    root = resolve_checkpoint(path_or_hub_id)
    if not (root / "config.json").is_file():
        raise ValueError(f"{root} has no config.json")
    cfg = ModelConfig.from_json(root / "config.json")
    tp = None
    if tp_size != 1:
        check_divisible(cfg, tp_size)  # before any process waits for another
        tp = parallel.init(tp_size, device)
        device = parallel.local_device(device, tp)
    weights = SafetensorsDir(root)
    state = gather(model_layout(cfg), weights.get, dtype, device,
                   shard=None if tp is None else (weights, tp.rank, tp.size))

    with torch.device("meta"):
        model = Transformer(cfg, tp)
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.rope = RotaryEmbedding(cfg, device=device)
    unloaded = [n for n, p in model.named_parameters() if p.is_meta]
    assert not unloaded, f"model_layout misses {unloaded}"
    model.eval().requires_grad_(False)
    if device.type == "cpu":
        pick_cpu_threads(sum(p.numel() for p in model.parameters()))

    return Target(model=model, config=cfg, tokenizer=_load_tokenizer(root), device=device, dtype=dtype,
                  name=str(path_or_hub_id), model_hash=weights.fingerprint(),
                  eos_token_ids=_eos_token_ids(root, cfg), tp=tp)


def _load_tokenizer(root: Path):
    if not (root / "tokenizer.json").is_file():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(root / "tokenizer.json"))


def _eos_token_ids(root: Path, cfg: ModelConfig) -> list[int]:
    """EOS ids from config.json, then generation_config.json (instruct models list several there)."""
    ids = list(cfg.eos_token_ids)
    gen = root / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        for i in [] if eos is None else [eos] if isinstance(eos, int) else eos:
            if i not in ids:
                ids.append(i)
    return ids


def check_prompt(tokens: Sequence[int], max_seq_len: int, max_new_tokens: int,
                 vocab_size: int | None = None) -> list[int]:
    """Validate one prompt before admission (the engine's check; the GPU forward does not sync to check).

    Returns the prompt as a list of ints; raises ValueError naming the problem.
    """
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    ids = [int(t) for t in tokens]
    if not ids:
        raise ValueError("empty prompt: at least one token is needed")
    if len(ids) + max_new_tokens > max_seq_len:
        raise ValueError(f"prompt of {len(ids)} tokens + max_new_tokens={max_new_tokens} exceeds "
                         f"max_seq_len={max_seq_len}")
    bad = [t for t in ids if t < 0 or (vocab_size is not None and t >= vocab_size)]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    return ids
