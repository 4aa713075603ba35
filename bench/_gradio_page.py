"""An open page of the web UI as the server sees it, for bench/ui_load.py --http: what Chromium sends while the
Runs tab is shown (recorded with Playwright: the Runs tab's gr.Timer fires its four handlers, the runs table and
run view, the Export panel, the Hub message and the queue row, each a `POST /gradio_api/run/predict` with the
inputs' values, the timer's id as trigger and the page's session hash, every 2 s; `queue=False`, so no SSE). The
server keeps each session's gr.State values by that hash, as for a browser. Values the page sends back (the
checkpoint dropdown, the Hub message) are taken from the replies, as the browser's components would hold them.
Other tabs' timers (Captions) do not fire while their tab is hidden, so they are not sent."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
import uuid

TIMER_TRIGGER = "tick"


def timer_handlers(url: str, select_elem_id: str = "run-select", poll_s: float = 2.0,
                   opened_api_name: str = "runs") -> list[dict]:
    """The handler a page runs once when it opens (the Runs tab's first render, `opened_api_name`: it gives this
    session its run choices, without which the server refuses the run's name), then the handlers the Runs tab's
    timer (the gr.Timer of `poll_s`) fires: [{fn_index, trigger_id, inputs: [(component id, type, elem_id, initial
    value)], outputs: [component ids]}] from the server's /config."""
    with urllib.request.urlopen(url.rstrip("/") + "/config", timeout=30) as r:
        config = json.load(r)
    comps = {c["id"]: c for c in config["components"]}
    timers = [i for i, c in comps.items() if c["type"] == "timer" and c["props"].get("value") == poll_s]
    runs_timer = next(t for t in timers
                      if any(any(comps[i]["props"].get("elem_id") == select_elem_id for i in d["inputs"])
                             for d in config["dependencies"] if [t, TIMER_TRIGGER] in d["targets"]))
    opened = next(d for d in config["dependencies"] if d.get("api_name") == opened_api_name)
    return [{"fn_index": d["id"], "trigger_id": runs_timer if d is not opened else None,
             "inputs": [(i, comps[i]["type"], comps[i]["props"].get("elem_id"), comps[i]["props"].get("value"))
                        for i in d["inputs"]], "outputs": list(d["outputs"])}
            for d in [opened] + [d for d in config["dependencies"] if [runs_timer, TIMER_TRIGGER] in d["targets"]]]


class Page(threading.Thread):
    """One open page: it opens (on the run being trained, which the UI picks), then polls while `active` is set;
    counts its requests and errors."""

    def __init__(self, url: str, handlers: list[dict], active: threading.Event,
                 stop: threading.Event, offset_s: float, poll_s: float = 2.0, select_elem_id: str = "run-select"):
        super().__init__(daemon=True)
        self.url, self.active, self.stop_event = url.rstrip("/"), active, stop
        self.open_handler, self.handlers = handlers[0], handlers[1:]
        self.offset_s, self.poll_s = offset_s, poll_s
        self.session = uuid.uuid4().hex[:10]
        self.values: dict[int, object] = {}  # what the page's components hold (states are kept by the server)
        for h in handlers:
            for cid, kind, elem_id, initial in h["inputs"]:
                self.values[cid] = None if kind == "state" else initial
                if elem_id == select_elem_id:
                    self.select_id = cid
        self.opened = threading.Event()  # its first render answered
        self.idle = threading.Event()  # set between ticks: no request of this page in flight
        self.idle.set()
        self.requests = self.errors = 0
        self._count = threading.Lock()  # a tick's requests answer on threads of their own
        self.last_error = ""

    def _post(self, h: dict) -> None:
        body = json.dumps({"data": [self.values.get(cid) for cid, *_ in h["inputs"]], "fn_index": h["fn_index"],
                           "trigger_id": h["trigger_id"], "session_hash": self.session}).encode()
        req = urllib.request.Request(self.url + "/gradio_api/run/predict", body,
                                     {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                out = json.load(r).get("data") or []
        except (OSError, ValueError) as exc:
            with self._count:
                self.errors += 1
            detail = exc.read()[:200] if isinstance(exc, urllib.error.HTTPError) else b""
            self.last_error = f"fn {h['fn_index']}: {exc} {detail!r}"
            return
        with self._count:
            self.requests += 1
        for cid, item in zip(h["outputs"], out):
            if cid in self.values and self._kind(cid) != "state":  # what the component shows now
                if isinstance(item, dict) and item.get("__type__") == "update":
                    if "value" in item:
                        self.values[cid] = item["value"]
                elif not (isinstance(item, dict) and item.get("__type__")):
                    self.values[cid] = item

    def _kind(self, cid: int) -> str:
        return next((k for h in self.handlers for c, k, *_ in h["inputs"] if c == cid), "")

    def run(self) -> None:
        if self.stop_event.wait(self.offset_s):  # pages opened at different moments, as people do
            return
        self._post(self.open_handler)  # the page opens on the run being trained, as the UI picks it
        self.opened.set()
        while not self.stop_event.is_set():
            if not self.active.wait(0.5):
                continue
            self.idle.clear()
            started = time.monotonic()
            # The browser sends a tick's requests together, one connection each, and (trigger_mode "once") skips
            # a tick while its previous request is pending: so do these.
            sent = [threading.Thread(target=self._post, args=(h,), daemon=True) for h in self.handlers]
            for t in sent:
                t.start()
            for t in sent:
                t.join()
            self.idle.set()
            self.stop_event.wait(max(0.0, self.poll_s - (time.monotonic() - started)))
