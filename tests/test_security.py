"""The attacker against a real, exposed UI (issue 10): `python launch.py --host 127.0.0.2` (a loopback address the
UI treats as reachable from other machines) with the login in IMAGETUNE_AUTH, driven through Gradio's HTTP API
like a script would, logged in. Every attack is refused, nothing is written outside the workspace, and no
response carries the secret in the server's environment. The fast tests of each defence are in
tests/test_security_units.py."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.browser_helpers import free_port
from tests.security_helpers import MALFORMED, image_folder, malformed_runs, stopped_run
from trainer.families.sd.demo import SHIPPED_MODEL

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
HOST = "127.0.0.2"
PASSWORD = "correct-horse-battery-staple"
SECRET = "s3cret-" + secrets.token_hex(8)
OUTSIDE_CAPTION = "caption-from-outside-" + secrets.token_hex(4)
PROXY = "127.0.0.5"  # the shared proxy in front of the UI (IMAGETUNE_TRUSTED_PROXIES)


def tree(path: Path) -> dict[str, int]:
    return {str(p.relative_to(path)): p.stat().st_size for p in path.rglob("*")} if path.exists() else {}


class UI:
    def __init__(self, root: Path):
        self.root, self.ws, self.outside = root, root / "ws", root / "outside"
        self.runs, self.port = self.ws / "runs", free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.responses: list[str] = []
        image_folder(self.ws / "data")
        image_folder(self.outside)
        (self.ws / "escape").symlink_to(self.outside)
        (self.ws / "yolo").mkdir()
        (self.ws / "yolo" / "data.yaml").write_text(f"train: {self.outside}\nnames: [thing]\n")
        self.victim = stopped_run(self.runs, self.ws / "data")
        # A demo run: its config.yaml holds the resolved demo://tiny-sd, the model shipped inside the package.
        self.demo_run = stopped_run(self.runs, self.ws / "data", "demo-run", model=SHIPPED_MODEL)
        # A kohya dataset whose sub-folder links out, one caption linking out; a dataset made only of a link.
        (self.outside / "caption.txt").write_text(OUTSIDE_CAPTION)
        image_folder(self.ws / "kohya" / "5_own")
        (self.ws / "kohya" / "10_linked").symlink_to(self.outside)
        (self.ws / "kohya" / "5_own" / "img1.txt").unlink()
        (self.ws / "kohya" / "5_own" / "img1.txt").symlink_to(self.outside / "caption.txt")
        (self.ws / "only-links").mkdir()
        (self.ws / "only-links" / "10_linked").symlink_to(self.outside)
        malformed_runs(self.runs)
        self.before = {"outside": tree(self.outside), "root": sorted(p.name for p in root.iterdir())}
        env = {**os.environ, "IMAGETUNE_AUTH": f"admin:{PASSWORD}", "IMAGETUNE_WORKSPACE": str(self.ws),
               "IMAGETUNE_TRUSTED_PROXIES": PROXY,
               "IMAGETUNE_HOME": str(self.ws / "home"), "SECRET_TOKEN": SECRET, "HF_HUB_OFFLINE": "1",
               "GRADIO_ANALYTICS_ENABLED": "False", "PYTHONUNBUFFERED": "1"}
        self.log = open(root / "ui.log", "wb")
        self.proc = subprocess.Popen(
            [sys.executable, str(REPO / "launch.py"), "--host", HOST, "--port", str(self.port), "--runs-dir",
             str(self.runs)], cwd=self.ws, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, (self.root / "ui.log").read_text()
            try:
                if httpx.get(self.url + "/", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError((self.root / "ui.log").read_text())

    def client(self):
        from gradio_client import Client

        return Client(self.url + "/", auth=("admin", PASSWORD), verbose=False)

    def call(self, client, *args, api_name: str) -> str:
        text = str(client.predict(*args, api_name=api_name))
        self.responses.append(text)
        return text

    def stop(self) -> None:
        # The whole session: the UI and what it started (its background build of the demo assets).
        for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 5)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(wait)
            except subprocess.TimeoutExpired:
                continue
        self.log.close()


@pytest.fixture(scope="module")
def ui(tmp_path_factory):
    app = UI(tmp_path_factory.mktemp("exposed"))
    try:
        app.wait_ready()
        app.gradio = app.client()
        yield app
    finally:
        app.stop()
    # After every attack: nothing outside the workspace changed, and no answer carried the secret.
    assert tree(app.outside) == app.before["outside"]
    assert {p.name for p in app.root.iterdir()} - {"ui.log"} == set(app.before["root"])
    assert not any(SECRET in r for r in app.responses)
    written = [p for p in app.ws.rglob("*") if ".demo" not in p.parts and p.is_file()]
    assert not [p for p in written if SECRET.encode() in p.read_bytes()]


def start_with_yaml(ui: UI, text: str) -> tuple[str, str]:
    """The YAML editor's text, then Start: (what the editor's event answered, what Start answered)."""
    edited = ui.call(ui.gradio, text, api_name="/on_yaml")
    return edited, ui.call(ui.gradio, api_name="/on_start")


def base_yaml(ui: UI, **sections) -> str:
    import yaml

    tree = {"name": "attack", "model": {"path": str(ui.ws / "data")}, "data": {"path": str(ui.ws / "data")},
            "devices": "cpu:1"}
    for key, value in sections.items():
        node = tree
        *head, last = key.split("__")
        for part in head:
            node = node.setdefault(part, {})
        node[last] = value
    return yaml.safe_dump(tree)


def runs_now(ui: UI) -> set[str]:
    return {p.name for p in ui.runs.iterdir()}


def test_interpolation_typed_into_the_ui_is_refused_at_its_field(ui):
    before = runs_now(ui)
    for key, value in (("name", "${oc.env:SECRET_TOKEN}"), ("data__path", "${oc.env:NOPE,/usr/share/pixmaps}"),
                       ("sample__prompts", ["${oc.env:SECRET_TOKEN}"])):
        edited, started = start_with_yaml(ui, base_yaml(ui, **{key: value}))
        assert "Not started" in started and "contains" in started and "${" in started, started
        assert "contains" in edited  # marked at its field as soon as it is typed
    assert runs_now(ui) == before


@pytest.mark.parametrize("case", ["data-outside", "data-symlink", "class-images", "class-images-created-via-link",
                                  "masks-via-link", "detection-weights", "detection-images", "detection-val",
                                  "yolo-descriptor"])
def test_paths_outside_the_workspace_are_refused(ui, case):
    out = str(ui.outside)
    detection = dict(model__family="detection", model__path="fcos_tiny", method="full", detection__weights="none")
    sections = {
        "data-outside": dict(data__path=out),
        "data-symlink": dict(data__path=str(ui.ws / "escape")),
        "class-images": dict(prior__enabled=True, prior__class_path=out + "/class", prior__class_prompt="a dog"),
        # Relative, one slash, not there yet (the run makes it): it once passed as a hub id and was written to.
        "class-images-created-via-link": dict(prior__enabled=True, prior__class_path="escape/created",
                                              prior__class_prompt="a dog"),
        "masks-via-link": dict(data__masks="escape/masks"),
        "detection-weights": {**detection, "detection__weights": out + "/w.safetensors"},
        "detection-images": {**detection, "detection__images": out},
        "detection-val": {**detection, "detection__val_path": out + "/val.json"},
        "yolo-descriptor": {**detection, "data__path": str(ui.ws / "yolo" / "data.yaml")},
    }[case]
    before = runs_now(ui)
    _, started = start_with_yaml(ui, base_yaml(ui, **sections))
    assert "Not started" in started and "outside the workspace" in started, started
    assert runs_now(ui) == before


def test_multi_node_is_refused(ui):
    _, started = start_with_yaml(ui, base_yaml(ui, distributed__nodes=2, distributed__master_addr="10.6.6.6"))
    assert "Not started" in started and "distributed.nodes" in started and "distributed.master_addr" in started


def test_a_saved_preset_keeps_schema_keys_only(ui):
    text = base_yaml(ui) + f"train: {{steps: 5}}\nval: {ui.outside}\npath: {ui.outside}\nnames: [x]\n"
    ui.call(ui.gradio, text, api_name="/on_yaml")
    assert "Saved as" in ui.call(ui.gradio, "mypreset", api_name="/on_save")
    saved = (ui.ws / "home" / "presets" / "mypreset.yaml").read_text()
    assert str(ui.outside) not in saved and "names" not in saved and "steps: 5" in saved
    ui.call(ui.gradio, base_yaml(ui, data__path=str(ui.outside)), api_name="/on_yaml")
    assert "Not saved" in ui.call(ui.gradio, "escape", api_name="/on_save")
    assert not (ui.ws / "home" / "presets" / "escape.yaml").exists()


def test_resume_with_changes_is_checked_like_a_new_run(ui):
    config = (ui.victim / "config.yaml").read_text()
    events = (ui.victim / "events.jsonl").read_text()
    ui.call(ui.gradio, api_name="/runs")  # the run list, as an opened page gets it, before choosing a run
    for change in (f"prior.class_path={ui.outside}/class", "train.steps=${oc.env:SECRET_TOKEN}",
                   "distributed.master_addr=10.6.6.6"):
        answer = ui.call(ui.gradio, "victim", change, api_name="/resume")
        assert "msg-box error" in answer and "Resumed" not in answer, answer
    assert (ui.victim / "config.yaml").read_text() == config and (ui.victim / "events.jsonl").read_text() == events
    assert not (ui.victim / "run.lock").exists() and not (ui.outside / "class").exists()


def test_the_dataset_check_is_confined(ui):
    for path in (str(ui.outside), str(ui.ws / "escape")):
        answer = ui.call(ui.gradio, path, "", ".txt", 512, api_name="/check_dataset")
        assert "outside the workspace" in answer and "img0" not in answer


def test_malformed_run_folders_show_as_unreadable_rows(ui):
    table = ui.call(ui.gradio, api_name="/runs")
    assert table.count("unreadable: ") >= len(MALFORMED) and "'stopped'" in table, table
    for name in (*MALFORMED, "victim"):  # each one selected: its page renders (the periodic refresh too)
        answer = ui.call(ui.gradio, name, api_name="/tick")
        assert name in answer


def test_cross_origin_and_rebinding_requests_are_refused(ui):
    evil = httpx.get(ui.url + "/config", headers={"Origin": "https://evil.example"})
    assert evil.status_code == 403 and "access-control-allow-origin" not in evil.headers
    preflight = httpx.options(ui.url + "/gradio_api/queue/join", headers={
        "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
    assert preflight.status_code == 403 and "access-control-allow-origin" not in preflight.headers
    rebound = httpx.get(ui.url + "/", headers={"Host": f"rebind.attacker.example:{ui.port}"})
    assert rebound.status_code == 403
    own = httpx.get(ui.url + "/", headers={"Origin": ui.url})
    assert own.status_code == 200
    login = httpx.post(ui.url + "/login", data={"username": "admin", "password": PASSWORD})
    cookies = login.headers.get_list("set-cookie")
    assert login.status_code == 200 and cookies and all("SameSite=Lax" in c and "SameSite=none" not in c
                                                        for c in cookies)


def test_failed_logins_back_off(ui):
    attacker = httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.3"))
    first = attacker.post(ui.url + "/login", data={"username": "admin", "password": "guess-1"})
    assert first.status_code == 400
    second = attacker.post(ui.url + "/login", data={"username": "admin", "password": PASSWORD})
    assert second.status_code == 429 and int(second.headers["retry-after"]) >= 1 and "set-cookie" not in second.headers
    assert httpx.post(ui.url + "/login", data={"username": "admin", "password": PASSWORD}).status_code == 200


def test_dataset_files_linking_out_of_the_workspace_are_not_read(ui):
    """A kohya sub-folder and a caption inside the workspace that link outside: the Dataset check neither counts,
    shows nor reads them, and a dataset made only of such links does not start."""
    answer = ui.call(ui.gradio, str(ui.ws / "kohya"), "", ".txt", 512, api_name="/check_dataset")
    assert "10_linked/: links outside the workspace" in answer and "| 10_linked |" not in answer, answer
    assert "| 5_own | 5 | 2 |" in answer and "img1.txt links outside the workspace" in answer
    assert OUTSIDE_CAPTION not in answer and str(ui.outside) not in answer
    before = runs_now(ui)
    _, started = start_with_yaml(ui, base_yaml(ui, data__path=str(ui.ws / "only-links")))
    assert "Not started" in started and "no images" in started, started
    assert runs_now(ui) == before


def test_a_demo_run_can_be_resumed(ui):
    """Its model lies in the package, outside the workspace: trusted as the shipped demo://tiny-sd."""
    ui.call(ui.gradio, api_name="/runs")
    answer = ui.call(ui.gradio, "demo-run", "", api_name="/resume")
    assert "Resumed" in answer and "outside the workspace" not in answer and "msg-box error" not in answer, answer
    # The same files under another name, where a run would write into them, stay refused.
    _, started = start_with_yaml(ui, base_yaml(ui, prior__enabled=True, prior__class_path=str(SHIPPED_MODEL),
                                               prior__class_prompt="a dog"))
    assert "Not started" in started and "prior.class_path" in started and "outside the workspace" in started


def test_numbers_no_setting_can_hold_are_named_at_their_field(ui):
    """A 29-digit seed once cut the event stream (Integer exceeds 64-bit range); 1e400 answered nothing."""
    before = runs_now(ui)
    edited, started = start_with_yaml(ui, base_yaml(ui, seed=99999999999999999999999999999))
    assert "<b>seed</b>: 999" in edited and "too large for a number setting" in edited, edited
    assert "Not started" in started and "seed" in started
    text = base_yaml(ui).replace("data:\n", "data:\n  resolution: 1e400\n", 1)
    edited, started = start_with_yaml(ui, text)
    assert "<b>data.resolution</b>: inf is not a finite number" in edited and "Not started" in started, edited
    assert runs_now(ui) == before


@pytest.mark.parametrize("key,value", [("train__steps", 10**12), ("data__resolution", 100000),
                                       ("batch__total", 10**9), ("sample__images_per_prompt", 10**8)])
def test_absurd_sizes_are_refused_naming_the_key(ui, key, value):
    before = runs_now(ui)
    _, started = start_with_yaml(ui, base_yaml(ui, **{key: value}))
    assert "Not started" in started and f"{key.replace('__', '.')}</b>: {value} is more than" in started, started
    assert runs_now(ui) == before


def test_a_wrong_guess_behind_the_shared_proxy_does_not_lock_out_the_owner(ui):
    """Everybody comes through the proxy's address; it names each visitor in X-Forwarded-For, which is believed
    from the trusted proxy only. The back-off is per visitor and user name."""
    proxy = httpx.Client(transport=httpx.HTTPTransport(local_address=PROXY))
    attacker, owner = {"X-Forwarded-For": "203.0.113.9"}, {"X-Forwarded-For": "198.51.100.7"}
    login = ui.url + "/login"
    assert proxy.post(login, data={"username": "admin", "password": "guess"}, headers=attacker).status_code == 400
    assert proxy.post(login, data={"username": "admin", "password": PASSWORD}, headers=attacker).status_code == 429
    assert proxy.post(login, data={"username": "admin", "password": PASSWORD}, headers=owner).status_code == 200
    # From an address that is not a trusted proxy the header is ignored: no fresh back-off per forged address.
    direct = httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.6"))
    assert direct.post(login, data={"username": "admin", "password": "guess"}, headers=attacker).status_code == 400
    forged = direct.post(login, data={"username": "admin", "password": "guess"}, headers=owner)
    assert forged.status_code == 429
    # The back-off is per user name too: guesses at `admin` do not slow down another name from that address.
    assert direct.post(login, data={"username": "root", "password": "guess"}).status_code == 400
