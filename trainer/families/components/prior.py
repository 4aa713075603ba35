"""DreamBooth prior preservation: make sure the class folder holds enough class images, generating the
missing ones with the base model before training (split across ranks, one file per image)."""

from __future__ import annotations

from pathlib import Path

from trainer.core.data.scan import scan_dataset


def ensure_class_images(draw, ctx) -> list:
    """The class images to train on (ImageItems captioned with the class prompt), generating missing ones with
    `draw(prompts, seeds, *, steps, size) -> images` (the family's sampler over the base model)."""
    prior = ctx.config.prior
    folder = Path(prior.class_path).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    have = scan_dataset(folder, instance_prompt=prior.class_prompt).items
    missing = prior.num_class_images - len(have)
    if missing > 0:
        if ctx.rank == 0:
            ctx.log_warning(f"prior: generating {missing} class images in {folder} with the base model")
        start = len(have)
        mine = [i for i in range(start, start + missing) if i % ctx.world_size == ctx.rank]
        for i in mine:
            name = folder / f"class-{i:05d}.png"
            if name.exists():
                continue
            image = draw([prior.class_prompt], [ctx.config.seed + i], steps=prior.sample_steps,
                         size=ctx.config.data.resolution)[0]
            tmp = name.with_suffix(".tmp.png")
            image.save(tmp)
            tmp.rename(name)
        ctx.accelerator.wait_for_everyone()
        have = scan_dataset(folder, instance_prompt=prior.class_prompt).items
        if len(have) < prior.num_class_images:
            from trainer.errors import UserError

            raise UserError(
                f"prior.class_path: {folder} holds {len(have)} of the {prior.num_class_images} class images after "
                "generating them; on several machines each node generates its share into its own disk. Put "
                "prior.class_path on storage every node shares, or generate the class images with a one-node run "
                "first (they are reused).")
    # Class images are captioned with the class prompt whatever their .txt says: that is what the prior means.
    return have[: prior.num_class_images]
