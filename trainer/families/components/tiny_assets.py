"""Tiny offline assets every family's demo shares: a CLIP-style BPE tokenizer over a small word list, the
generated shapes dataset (`demo://demo-data`), and the atomic build-once helper every demo builder uses.

Nothing here touches the network or imports torch: the assets are files, built where the run folder's
`.demo/` lives, by whichever process gets there first (the others wait for the rename).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path

from trainer.errors import UserError

DATA_DIR = "demo-data"
# Latent downsampling of the tiny demo VAEs (3 encoder blocks -> 2 downsamples). With a UNet's sample_size=16
# the pipeline's default output is 64 px, the size of the demo dataset.
VAE_SCALE_FACTOR = 4
DATA_MARKER = "0000_red_circle.txt"


# Words the tokenizer learns whole-word merges for, so demo prompts encode as a few meaningful tokens rather
# than one token per letter. "sks" is the customary DreamBooth identifier, a single token in real CLIP too.
TOKENIZER_CORPUS = """
a an the of on in with and or at to by for from as is it this that his her their its are be very one two three
photo photograph picture image painting drawing render sketch illustration style art artwork digital oil canvas
portrait closeup close up view shot scene landscape high quality detailed highly simple plain clean sharp soft
background foreground white black gray grey red green blue yellow orange purple pink brown cyan magenta beige gold
silver light dark bright colorful small large big tiny little round flat smooth shiny old new young beautiful
circle square triangle star heart shape shapes object objects pattern texture line lines
dog cat bird horse animal person people man woman girl boy child face eyes hair smile hat shirt dress
house building city street road room table chair window door garden park forest tree trees flower flowers
car sky sun moon cloud clouds sea ocean water river lake beach mountain mountains snow rain night day sunset
cartoon anime realistic photorealistic cinematic lighting studio camera lens film vintage modern fantasy
wood metal glass stone paper sand grass leaf leaves fire shadow reflection wall floor ground
toy robot castle bridge boat
sks ohwx token
""".split()

SPECIALS = ("<|startoftext|>", "<|endoftext|>")


# ----------------------------------------------------------------------------------------------------------------
# Tokenizer


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2/CLIP's reversible byte -> printable unicode map; byte-level BPE vocabularies are written in it."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    codes = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, codes)}


def build_bpe(vocab_size: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Learn CLIP-style BPE merges on the small word list, in CLIP's vocabulary order.

    Order as in openai/clip-vit-large-patch14: 256 byte symbols, the same with `</w>`, merged symbols, then the
    two specials last. Every byte is in the base vocabulary, so any text (any language, emoji) still encodes.
    """
    byte_symbols = list(bytes_to_unicode().values())
    vocab_list = byte_symbols + [s + "</w>" for s in byte_symbols]
    budget = vocab_size - len(vocab_list) - len(SPECIALS)

    encode = bytes_to_unicode()
    words: dict[tuple[str, ...], int] = {}
    for word in TOKENIZER_CORPUS:
        chars = [encode[b] for b in word.encode("utf-8")]
        chars[-1] += "</w>"
        words[tuple(chars)] = words.get(tuple(chars), 0) + 1

    merges: list[tuple[str, str]] = []
    known = set(vocab_list)
    while len(merges) < budget:
        pairs: dict[tuple[str, str], int] = {}
        for symbols, count in words.items():
            for pair in zip(symbols, symbols[1:]):
                pairs[pair] = pairs.get(pair, 0) + count
        if not pairs:
            break
        # Most frequent first; ties broken by the pair itself so the vocabulary never depends on dict order.
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        merged = best[0] + best[1]
        if merged not in known:
            known.add(merged)
            vocab_list.append(merged)
        words = {apply_merge(symbols, best, merged): c for symbols, c in words.items()}

    vocab_list += list(SPECIALS)
    return {token: i for i, token in enumerate(vocab_list)}, merges


def apply_merge(symbols: tuple[str, ...], pair: tuple[str, str], merged: str) -> tuple[str, ...]:
    out: list[str] = []
    i = 0
    while i < len(symbols):
        if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == pair:
            out.append(merged)
            i += 2
        else:
            out.append(symbols[i])
            i += 1
    return tuple(out)


def write_clip_tokenizer(folder: Path, vocab: dict[str, int], merges: list[tuple[str, str]]) -> None:
    """Write the files both the slow (transformers 4.x) and the tokenizers-backed (5.x) CLIPTokenizer read."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    # The first line is a header that every CLIP merges reader skips.
    lines = ["#version: 0.2"] + [f"{a} {b}" for a, b in merges]
    (folder / "merges.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    config = {
        "tokenizer_class": "CLIPTokenizer",
        "model_max_length": 77,
        "bos_token": SPECIALS[0],
        "eos_token": SPECIALS[1],
        "unk_token": SPECIALS[1],
        "pad_token": SPECIALS[1],
        "do_lower_case": True,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    specials = {k: config[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
    (folder / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n", encoding="utf-8")



# ----------------------------------------------------------------------------------------------------------------
# Dataset

# One fixed colour per shape keeps the concept-to-caption mapping simple enough for a tiny model to pick up in a
# few hundred CPU steps, which is the point of the demo: the samples visibly change as it trains.
_SHAPES = (("red", "circle", (215, 45, 45)), ("blue", "square", (45, 85, 215)), ("green", "triangle", (40, 165, 65)))
_BACKGROUNDS = (("white", (245, 245, 245)), ("gray", (135, 135, 135)), ("beige", (230, 214, 178)))
_SUPERSAMPLE = 4  # draw large then downscale: PIL's polygon/ellipse drawing has no antialiasing


def make_demo_dataset(folder, *, count: int = 16, size: int = 64, seed: int = 0) -> Path:
    """Write `count` PNG images of coloured shapes with same-name `.txt` captions to `folder`; return its path.

    Images cycle through a red circle, a blue square and a green triangle on a white, gray or beige background,
    with random position, size and a little colour jitter. Captions read "a photo of a red circle on a white
    background". The same seed gives the same files.
    """
    from PIL import Image, ImageDraw

    if count < 1:
        raise UserError(f"The demo dataset needs at least one image, not count={count}.")
    if size < 8:
        raise UserError(f"The demo dataset's image size must be at least 8 px, not {size}.")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    big = size * _SUPERSAMPLE
    for i in range(count):
        colour, shape, rgb = _SHAPES[i % len(_SHAPES)]
        bg_name, bg = rng.choice(_BACKGROUNDS)
        fill = tuple(min(255, max(0, c + rng.randint(-20, 20))) for c in rgb)
        extent = rng.uniform(0.35, 0.65) * big
        x0 = rng.uniform(0.05 * big, big * 0.95 - extent)
        y0 = rng.uniform(0.05 * big, big * 0.95 - extent)
        box = (x0, y0, x0 + extent, y0 + extent)

        image = Image.new("RGB", (big, big), bg)
        draw = ImageDraw.Draw(image)
        if shape == "circle":
            draw.ellipse(box, fill=fill)
        elif shape == "square":
            draw.rectangle(box, fill=fill)
        else:
            draw.polygon([(x0 + extent / 2, y0), (x0 + extent, y0 + extent), (x0, y0 + extent)], fill=fill)
        image = image.resize((size, size), Image.Resampling.LANCZOS)

        stem = f"{i:04d}_{colour}_{shape}"
        image.save(folder / f"{stem}.png")
        (folder / f"{stem}.txt").write_text(f"a photo of a {colour} {shape} on a {bg_name} background\n")
    return folder



# ----------------------------------------------------------------------------------------------------------------
# Built once, atomically


def ensure_asset(target: Path, build, marker: str) -> Path:
    """`build(folder)` into `target` unless it exists (atomically, see ensure_demo_assets); `marker` is the
    file a complete asset has."""
    if not target.exists():
        build_atomically(build, target)
    if not (target / marker).is_file():
        raise UserError(
            f"{target} exists but is not a complete demo asset (no {marker}). Delete it and it will be rebuilt."
        )
    return target


def build_atomically(build, target: Path) -> None:
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        build(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it owner-only; the asset is meant to be shared like any folder
        try:
            os.rename(tmp, target)
        except OSError:
            # Another process renamed its copy in first (the target is now a non-empty folder): use theirs.
            if not target.exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def ensure_demo_data(root) -> dict[str, Path]:
    """`root/demo-data` (the shapes dataset), built once; {"demo-data": path}."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    return {DATA_DIR: ensure_asset(root / DATA_DIR, make_demo_dataset, DATA_MARKER)}
