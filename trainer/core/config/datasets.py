"""`data.datasets`: several image folders in one run, each with its own settings (kohya's subsets, OneTrainer's
concepts). An entry's unset setting is the `data.*` key of the same name; `data.path` alone is the short form of
one entry. Resolved into `trainer.core.data.sources.Source`s, which is all the rest of the engine reads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from trainer.core.config.fields import key


@dataclass
class DatasetEntry:
    path: str = key("", "The folder of captioned images (the layouts data.path takes, kohya `N_concept` folders "
                        "included), or `demo://demo-data`.")
    repeats: int = key(1, "How many times this folder's images appear per epoch, on top of kohya folder repeats "
                          "(`10_sks dog/` with repeats 2 appears 20 times): the share of each dataset in training.")
    resolution: Optional[int] = key(
        None, "Training resolution of this folder's images; unset: data.resolution. Steps never mix sizes: every "
        "optimizer step's batch comes from one size (as with aspect-ratio buckets).")
    flip: Optional[bool] = key(None, "Random horizontal flips for this folder; unset: data.flip.")
    instance_prompt: Optional[str] = key(None, "Caption of this folder's images that have none; unset: "
                                               "data.instance_prompt.")
    caption_extension: Optional[str] = key(None, "Caption file extension; unset: data.caption_extension.")
    caption_prefix: Optional[str] = key(None, "Text put in front of this folder's captions; unset: "
                                              "data.caption_prefix.")
    caption_dropout: Optional[float] = key(None, "This folder's caption dropout; unset: data.caption_dropout.")
    shuffle_tags: Optional[bool] = key(None, "Shuffle this folder's tags; unset: data.shuffle_tags.")
    keep_tokens: Optional[int] = key(None, "Tags kept in place when shuffling; unset: data.keep_tokens.")
    is_regularization: bool = key(
        False, "Regularization images (kohya's `reg` folders; DreamBooth prior preservation from a folder of your "
        "own): every training sample is paired with one of these, trained on its own caption, and its loss is "
        "added with weight prior.loss_weight. Never held out, never counted in an epoch. Not with prior.enabled, "
        "which generates class images instead.")
