"""Keeping the libraries' chatter out of train.log, which is for people (trainer.core.runlog writes its lines).

Loading bars and import-time notices are switched off. What the libraries still say (deprecation notices, diffusers'
and transformers' log lines, DeepSpeed's) goes to `library.log` beside train.log, so nothing is lost; their errors,
and warnings that are not about deprecations (a UserWarning about the run's own tensors), still reach train.log.
"""

from __future__ import annotations

import logging
import sys
import warnings
from pathlib import Path

LIBRARY_LOG = "library.log"
DEPRECATIONS = (DeprecationWarning, PendingDeprecationWarning, FutureWarning)


def quiet_library_chatter(run_dir: Path | None = None) -> None:
    """No loading bars, no import-time notices of optional packages (torchao's enum registrations, diffusers
    looking for torchao classes that have moved); with `run_dir`, the rest of the chatter into its library.log."""
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
    logging.getLogger("diffusers.quantizers.torchao.torchao_quantizer").setLevel(logging.ERROR)
    from diffusers.utils import logging as diffusers_logging
    from huggingface_hub.utils import disable_progress_bars
    from transformers.utils import logging as transformers_logging

    diffusers_logging.disable_progress_bar()
    transformers_logging.disable_progress_bar()
    disable_progress_bars()
    if run_dir is None:
        return
    to_file = logging.FileHandler(Path(run_dir) / LIBRARY_LOG, encoding="utf-8", delay=True)
    to_file.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s: %(message)s"))
    errors = logging.StreamHandler(sys.stderr)
    errors.setLevel(logging.ERROR)
    for library in (diffusers_logging, transformers_logging):
        library.disable_default_handler()
        library.add_handler(to_file)
        library.add_handler(errors)
    # DeepSpeed gives its logger a stdout handler when it is imported (later, maybe never): a filter on the logger
    # itself runs before any handler, whenever that is.
    logging.getLogger("DeepSpeed").addFilter(_Divert(to_file))
    shown = warnings.showwarning

    def showwarning(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, DEPRECATIONS):
            to_file.handle(logging.LogRecord("py.warnings", logging.WARNING, filename, lineno,
                                             f"{category.__name__}: {message} ({filename}:{lineno})", None, None))
        else:
            shown(message, category, filename, lineno, file, line)

    warnings.showwarning = showwarning


class _Divert(logging.Filter):
    """Hands a record below ERROR to `handler` and drops it from its logger's own handlers."""

    def __init__(self, handler: logging.Handler):
        super().__init__()
        self.handler = handler

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR:
            return True
        self.handler.handle(record)
        return False
