"""Keeping the libraries' chatter out of train.log, which is for people: the training processes and an export
(trainer.engine.export) print the same lines that matter."""

from __future__ import annotations

import logging


def quiet_library_chatter() -> None:
    """No loading bars, no import-time notices of optional packages (torchao's enum registrations, diffusers
    looking for torchao classes that have moved). Their warnings about the run itself still come through."""
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
    logging.getLogger("diffusers.quantizers.torchao.torchao_quantizer").setLevel(logging.ERROR)
    from diffusers.utils import logging as diffusers_logging
    from huggingface_hub.utils import disable_progress_bars
    from transformers.utils import logging as transformers_logging

    diffusers_logging.disable_progress_bar()
    transformers_logging.disable_progress_bar()
    disable_progress_bars()
