"""What the target and draft training loops share: device, precision, schedule, checkpoints, progress."""

from __future__ import annotations

import contextlib
import math
import os
import random
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

CHECKPOINT_NAME = "train_state.pt"


def resolve_device(name: str | None) -> torch.device:
    """``"auto"``/None picks CUDA when present; an unusable device is a ValueError, not a crash later."""
    if name in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"unknown device {name!r}") from e
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for, but CUDA is not available here")
    return device


def seed_everything(seed: int) -> None:
    """Seed Python, torch (CPU and CUDA) so a run is repeatable."""
    random.seed(seed)
    torch.manual_seed(seed)


def autocast(device: torch.device):
    """bf16 autocast on GPU (the weights and optimizer stay float32); full float32 on CPU."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warmup to ``peak``, then cosine decay to a tenth of it at ``total``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def epoch_steps(epochs: float, tokens: int, batch_size: int, seq_len: int) -> int:
    """Steps of ``batch_size`` x ``seq_len`` tokens that make ``epochs`` passes over ``tokens`` (0 if epochs is 0)."""
    return max(1, round(epochs * tokens / (batch_size * seq_len))) if epochs > 0 else 0


def make_optimizer(params, lr: float, weight_decay: float, fused: bool) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (norm gains and biases are left alone)."""
    params = [p for p in params if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    other = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": other, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=fused)


def check_gradients(module: torch.nn.Module) -> None:
    """Raise if a trainable parameter got no gradient: some op on the way has no backward.

    Custom (Triton) kernels return tensors without autograd history; used in training they would
    silently cut the graph and train only what lies after them.
    """
    missing = [n for n, p in module.named_parameters() if p.requires_grad and p.grad is None]
    if missing:
        raise RuntimeError(
            f"no gradient reached {len(missing)} parameter(s) ({', '.join(missing[:3])}, ...): an op of the "
            "model has no backward on this device; spectool/kernels/ops.py must take its torch path when "
            "gradients are needed")


def restore_checkpoint(state: dict | None, key: str, module: torch.nn.Module, opt: torch.optim.Optimizer,
           gen: torch.Generator) -> int:
    """Restore ``state[key]`` into ``module`` with the optimizer and data generator; returns the
    step to continue from (0 without a checkpoint)."""
    if state is None:
        return 0
    module.load_state_dict(state[key])
    opt.load_state_dict(state["optimizer"])
    gen.set_state(state["generator"])
    print(f"resuming from step {state['step']}")
    return state["step"]


def apply_gradients(module: torch.nn.Module, opt: torch.optim.Optimizer, first: bool) -> None:
    """Clip, step and clear; on the first step also check every parameter got a gradient."""
    if first:
        check_gradients(module)
    torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)


def atomic_save(obj, path: str | Path) -> None:
    """torch.save to a temporary file, then rename: an interruption never leaves a torn checkpoint."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def load_checkpoint(out_dir: str | Path) -> dict | None:
    """The training state saved in ``out_dir``, or None when there is none."""
    path = Path(out_dir) / CHECKPOINT_NAME
    if not path.is_file():
        return None
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # a foreign or damaged file: say which, do not guess
        raise ValueError(f"cannot read checkpoint {path}: {e}") from e


def oom_exit(batch_size: int, out_dir: str | Path) -> SystemExit:
    """The error a user sees when a batch does not fit on the GPU."""
    smaller = max(1, batch_size // 2)
    return SystemExit(
        f"CUDA out of memory at --batch-size {batch_size}; try --batch-size {smaller} "
        f"(or a shorter --seq-len). Checkpoints already in {out_dir} are intact; add --resume to continue.")


class Progress:
    """A tqdm bar showing the loss and tokens/s; silent when ``enabled`` is False."""

    def __init__(self, total: int, initial: int, desc: str, enabled: bool = True):
        self.bar = tqdm(total=total, initial=initial, desc=desc, disable=not enabled, dynamic_ncols=True)
        self.t0 = time.perf_counter()
        self.tokens = 0

    def update(self, tokens: int, **fields: float) -> None:
        self.tokens += tokens
        rate = self.tokens / max(1e-9, time.perf_counter() - self.t0)
        self.bar.set_postfix({k: f"{v:.3f}" for k, v in fields.items()} | {"tok/s": f"{rate:,.0f}"},
                             refresh=False)
        self.bar.update(1)

    def tokens_per_second(self) -> float:
        return self.tokens / max(1e-9, time.perf_counter() - self.t0)

    def close(self) -> None:
        self.bar.close()


def train_loop(step_fn, save_fn, *, start: int, steps: int, checkpoint_every: int, batch_size: int,
               out_dir: str | Path, desc: str, progress: bool = True, max_seconds: float | None = None,
               log_every: int = 10, calibrate_steps: int = 10) -> dict:
    """Run ``step_fn(step, total) -> (loss tensor, tokens)`` from ``start`` to ``total``, checkpointing.

    ``total`` is ``steps``, or fewer under a time budget: with ``max_seconds``, the speed of the
    first ``calibrate_steps`` steps fixes how many fit, so the learning-rate schedule (which
    reads ``total``) still ends properly; a hard stop at ``max_seconds`` backs this up.
    ``save_fn(step)`` writes the checkpoint every ``checkpoint_every`` steps and at the end.
    The loss is read back only every ``log_every`` steps (a read is a device sync).
    CUDA OOM and Ctrl-C end the run with a message, leaving the last checkpoint as it was.

    Returns ``{"steps", "planned_steps", "tokens_per_s", "loss_history", "stopped_early"}``.
    """
    bar = Progress(steps, start, desc, progress)
    history: list[list[float]] = []
    step, total, loss_value, stopped_early = start, steps, float("nan"), False
    t_first = None
    try:
        while step < total:
            if max_seconds is not None and time.perf_counter() - bar.t0 > max_seconds:
                stopped_early = True
                break
            loss, tokens = step_fn(step, total)
            step += 1
            if step == start + 1:
                t_first = time.perf_counter()  # the first step pays for warm-up; time from here
            if max_seconds is not None and step == start + 1 + calibrate_steps:
                float(loss)  # sync so the clock sees the finished work
                per_step = (time.perf_counter() - t_first) / calibrate_steps
                left = max_seconds - (time.perf_counter() - bar.t0)
                total = min(steps, step + max(0, int(left / per_step)))
                bar.bar.total = total
            if step % log_every == 0 or step == total:
                loss_value = float(loss)
                history.append([step, loss_value])
            bar.update(tokens, loss=loss_value)
            if step % checkpoint_every == 0 or step == total:
                save_fn(step)
    except torch.cuda.OutOfMemoryError:
        raise oom_exit(batch_size, out_dir) from None
    except KeyboardInterrupt:
        raise SystemExit(f"interrupted at step {step}; the last checkpoint in {out_dir} is intact, "
                         "rerun the same command with --resume to continue") from None
    finally:
        bar.close()
    if stopped_early:
        save_fn(step)
        print(f"{desc}: time budget of {max_seconds:.0f}s reached at step {step} of {total}")
    return {"steps": step, "planned_steps": steps, "tokens_per_s": bar.tokens_per_second(),
            "loss_history": history, "stopped_early": stopped_early}
