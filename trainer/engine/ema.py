"""The exponential moving average of the trained weights (`full.ema`, `lora.ema`): diffusers' EMAModel, stepped
by the loop after every optimizer update, saved in checkpoints' training_state.pt, and swapped in wherever a user
looks at the model (samples, evaluations, outputs) by `ema_weights`."""

from __future__ import annotations

from contextlib import contextmanager

from trainer.core.config import Config


def ema_decay(config: Config) -> float | None:
    """The run's EMA decay, or None when it keeps no average."""
    if config.method == "full" and config.full.ema:
        return config.full.ema_decay
    if config.method == "lora" and config.lora.ema:
        return config.lora.ema_decay
    return None


def build_ema(config: Config, params):
    decay = ema_decay(config)
    if decay is None:
        return None
    from diffusers.training_utils import EMAModel

    return EMAModel(list(params), decay=decay)


@contextmanager
def ema_weights(run):
    """Inside, the trained parameters hold the average; on exit, the live weights again, copied back bit for bit
    (EMAModel.store/restore), so a run that samples trains exactly like one that does not. No EMA: nothing."""
    if run.ema is None:
        yield
        return
    params = list(run.trainable_params())
    run.ema.store(params)
    run.ema.copy_to(params)
    try:
        yield
    finally:
        run.ema.restore(params)
