"""torchrun's agent, ending the way the workers do (trainer.engine.worker.exit_now). Started by
trainer.core.launcher for a run of several processes or nodes, with torchrun's own arguments:

    python -m trainer.engine.torchrun --standalone --nproc-per-node 2 ... --module trainer.engine.worker RUN_DIR

It is `python -m torch.distributed.run` (the same parser, agent, rendezvous and failure report) until the agent
has returned. By then every worker has exited, the agent has closed its process context (which stops and drains
the threads that copy the workers' output into train.log) and passed its exit barrier. What was left was the
interpreter's teardown of torch: on 2 busy cores (load 6-7) the launcher saw a 2-process demo LoRA run end 2.25 and
2.28 s after its `done` event under torchrun, 0.63 and 0.69 s with this, alternating (a one-process run: 0.23 s).
A failure is untouched: torchrun raises, prints its report and exits 1 as before.
"""

from __future__ import annotations

import os
import sys

from torch.distributed.run import main

if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
