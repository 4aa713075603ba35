"""Caption augmentation (`data.caption_prefix`, `data.caption_dropout`, `data.shuffle_tags`, `data.keep_tokens`),
torch-free: the caption a training sample is conditioned on, as a pure function of (seed, stream position, its
caption).

Each position draws from a `random.Random` of its own, seeded by `position_seed(seed, position, CAPTION_STREAM)`:
never the noise generator's stream, so turning these keys on leaves every noise, timestep and crop draw as it was,
and a sample's caption is the same on 1 or N processes and after a resume (no state is carried between draws).
The dropout coin is always drawn first, so changing the dropout rate never reshuffles the samples it keeps.

What a text-embedding cache must hold follows from this (`cacheable`, `cached_captions`): the prefix is fixed, so
the prefixed captions are cached instead of the plain ones; dropout adds one variant, the empty caption; shuffled
tags are a new caption at almost every position, so a run that shuffles encodes its captions every step.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass

from trainer.core.data.stream import position_seed

CAPTION_STREAM = 0xCA97
"""`position_seed` stream of the caption draws: apart from the samples' noise (0, 1, 2) and the loop's (1000 + rank)."""
TAG_SEPARATOR = ","


def split_tags(caption: str) -> list[str]:
    """The comma-separated tags of a caption, stripped, empty ones (a trailing comma) left out."""
    return [tag.strip() for tag in caption.split(TAG_SEPARATOR) if tag.strip()]


@dataclass(frozen=True)
class CaptionAugment:
    prefix: str = ""
    dropout: float = 0.0
    shuffle: bool = False
    keep_tokens: int = 0

    @classmethod
    def from_config(cls, data) -> CaptionAugment:
        """From the config's data section."""
        return cls(prefix=data.caption_prefix.strip(), dropout=float(data.caption_dropout),
                   shuffle=bool(data.shuffle_tags), keep_tokens=int(data.keep_tokens))

    @property
    def cacheable(self) -> bool:
        """Whether every caption a run trains on is known before it starts (all but shuffled tags)."""
        return not self.shuffle

    def fixed(self, caption: str) -> str:
        """The caption with the prefix, as held-out images see it (no draws)."""
        return f"{self.prefix} {caption}" if self.prefix and caption else self.prefix or caption

    def cached_captions(self, captions: Iterable[str]) -> list[str]:
        """What a text cache holds for these captions when `cacheable`: each with the prefix, and the empty
        caption when captions are dropped."""
        out = [self.fixed(c) for c in captions]
        return out + [""] if self.dropout > 0 else out

    def draw(self, caption: str, *, seed: int, position: int) -> str:
        """The caption the training sample at stream `position` is conditioned on."""
        if not (self.dropout > 0 or self.shuffle):
            return self.fixed(caption)
        rng = random.Random(position_seed(seed, position, CAPTION_STREAM))
        if rng.random() < self.dropout:
            return ""
        if self.shuffle:
            tags = split_tags(caption)
            kept, rest = tags[:self.keep_tokens], tags[self.keep_tokens:]
            rng.shuffle(rest)
            caption = ", ".join(kept + rest)
        return self.fixed(caption)
