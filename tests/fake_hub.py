"""A stand-in for the Hugging Face Hub's HTTP API on 127.0.0.1 (NOT the real Hub): the few endpoints that
huggingface_hub's create_repo, create_commit and model_info call, enough to receive an upload and keep what
arrived. Files are uploaded inline ("regular" mode), so no LFS or Xet storage is involved."""

from __future__ import annotations

import base64
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import yaml


class FakeHub:
    def __init__(self, licences: dict[str, str] | None = None, refuse: int | None = None):
        self.licences = licences or {}  # base model id -> the licence its card states
        self.refuse = refuse  # an HTTP status every write answers with (e.g. 403), to test failures
        self.repos: dict[str, dict] = {}  # repo id -> {"private": bool, "files": {path: bytes}}
        self.authorizations: list[str] = []
        self.card_metadata: dict = {}  # the model card's YAML front matter, as the Hub's validate-yaml read it
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> "FakeHub":
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _reply(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                match = re.fullmatch(r"/api/models/([^/]+/[^/?]+)(?:/revision/[^/?]+)?(\?.*)?", self.path)
                if match and match.group(1) in hub.licences:
                    self._reply(200, {"id": match.group(1), "sha": "0" * 40,
                                      "cardData": {"license": hub.licences[match.group(1)]}})
                else:
                    self._reply(404, {"error": "Repository not found"})

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                hub.authorizations.append(self.headers.get("Authorization", ""))
                if hub.refuse:
                    return self._reply(hub.refuse, {"error": "You don't have the rights to create a model here"})
                if self.path == "/api/validate-yaml":  # the model card's front matter must be YAML
                    content = json.loads(body)["content"]
                    front = content.split("---")[1] if content.startswith("---") else ""
                    try:
                        hub.card_metadata = yaml.safe_load(front) or {}
                    except yaml.YAMLError as exc:
                        return self._reply(400, {"errors": [{"message": str(exc)}]})
                    return self._reply(200, {"errors": [], "warnings": []})
                if self.path == "/api/repos/create":
                    request = json.loads(body)
                    repo = f"{request['organization']}/{request['name']}" if request.get("organization") else \
                        request["name"]
                    private = bool(request.get("private")) or request.get("visibility") == "private"  # old / new
                    hub.repos.setdefault(repo, {"private": private, "files": {}})
                    return self._reply(200, {"url": f"{hub.url}/{repo}", "name": repo})
                match = re.fullmatch(r"/api/models/([^/]+/[^/]+)/(preupload|commit)/([^/?]+)(\?.*)?", self.path)
                if match is None or match.group(1) not in hub.repos:
                    return self._reply(404, {"error": f"no route {self.path}"})
                repo = match.group(1)
                if match.group(2) == "preupload":
                    files = json.loads(body)["files"]
                    return self._reply(200, {"files": [{"path": f["path"], "uploadMode": "regular",
                                                        "shouldIgnore": False} for f in files]})
                for line in body.decode().splitlines():
                    item = json.loads(line)
                    if item["key"] == "file":
                        hub.repos[repo]["files"][item["value"]["path"]] = base64.b64decode(item["value"]["content"])
                self._reply(200, {"commitUrl": f"{hub.url}/{repo}/commit/{'1' * 40}", "commitOid": "1" * 40,
                                  "pullRequestUrl": None})

        return Handler
