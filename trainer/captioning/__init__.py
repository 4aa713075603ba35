"""Auto-captioning of a training folder (`python launch.py --caption FOLDER`, the Dataset tab's Caption panel).

`registry` (torch-free) says which captioners exist and how each kind is prompted; `files` (torch-free) which
images get a caption file and writes them atomically; `models` loads a vision-language model through transformers
or a booru tagger through timm (torch imported there only); `run` captions a folder with progress and releases the
model afterwards; `__main__` is the process that does it (`python -m trainer.captioning`, started by
`launch.py --caption`, which stays torch-free like the UI that starts it in turn).
"""
