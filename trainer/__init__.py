"""The training engine: presets -> planned distributed runs -> run folders.

Nothing here imports gradio; `trainer.config`, `trainer.plan` (its pure part), `trainer.events` and
`trainer.data.scan` are also safe to import without torch, so the UI can use them.
"""
