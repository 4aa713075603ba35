"""The training engine: presets -> planned distributed runs -> run folders.

Nothing here imports gradio; `trainer.core.config`, `trainer.core.plan` (its pure part), `trainer.core.events` and
`trainer.core.data.scan` are also safe to import without torch, so the UI can use them.
"""
