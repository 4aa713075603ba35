"""The Runs tab's samples as a grid: one row per prompt, one column per sample step (oldest left), so a prompt's
progress reads across and the prompts of one step read down. Torch- and Gradio-free: HTML from the run's events.

Images are served by Gradio's file route (the runs folder is its only allowed path), by a URL relative to the
page, so a UI behind a path prefix still finds them. A click enlarges an image in place (a CSS :target overlay,
no script: the page's HTML component runs none); a click on the enlarged image closes it.
"""

from __future__ import annotations

import html
from pathlib import Path
from urllib.parse import quote

from app import runs as R

FILE_ROUTE = "gradio_api/file="
MAX_STEPS = 24  # columns shown: the newest ones (older steps stay in samples/ and in train.log)


def image_url(path: Path) -> str:
    return FILE_ROUTE + quote(str(path))


def grid_html(view: R.RunView | None) -> str:
    """The prompt x step grid of `view`'s samples whose files exist; "" when it has none."""
    if view is None:
        return ""
    cells = {key: event for key, event in view.samples.items() if (view.path / event.path).is_file()}
    if not cells:
        return ""
    steps = sorted({step for step, _ in cells})[-MAX_STEPS:]
    prompts: dict[int, str] = {}
    for step, index in sorted(cells):
        prompts[index] = cells[(step, index)].prompt or prompts.get(index, "")  # each prompt's newest wording
    head = "".join(f'<th class="grid-step" data-step="{s}">step {s}</th>' for s in steps)
    rows, overlays = [], []
    for index in sorted(prompts):
        row = [f'<th class="grid-prompt" title="{html.escape(prompts[index], quote=True)}">'
               f'<span class="grid-index">#{index}</span> {html.escape(prompts[index])}</th>']
        for step in steps:
            sample = cells.get((step, index))
            if sample is None:
                row.append('<td class="grid-empty"></td>')
                continue
            anchor = f"sample-{view.name}-{step}-{index}"
            url = html.escape(image_url(view.path / sample.path), quote=True)
            alt = html.escape(f"step {step} · {prompts[index]}", quote=True)
            row.append(f'<td><a href="#{html.escape(anchor, quote=True)}"><img src="{url}" alt="{alt}" '
                       f'loading="lazy"></a></td>')
            overlays.append(f'<a class="grid-zoom" id="{html.escape(anchor, quote=True)}" href="#samples-grid">'
                            f'<img src="{url}" alt="{alt}"><span>{alt}</span></a>')
        rows.append(f"<tr>{''.join(row)}</tr>")
    shown = "" if len(steps) == len({s for s, _ in cells}) else \
        f'<div class="grid-note">the newest {MAX_STEPS} sample steps; every sample is in samples/</div>'
    return (f'<div class="sample-grid" id="samples-grid"><table><thead><tr><th class="grid-corner">prompt \\ step'
            f'</th>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table>{shown}{"".join(overlays)}</div>')
