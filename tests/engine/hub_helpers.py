"""Hugging Face hub stand-ins for the loader tests: a model laid out in a hub cache as huggingface_hub's downloads
lay it out, a fake hub served in memory (httpx2.MockTransport behind huggingface_hub's HTTP client), and a local
port nothing listens on. Nothing here reaches the network."""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx2
import huggingface_hub
from huggingface_hub.utils import _http

COMMIT = hashlib.sha1(b"rose-test-commit").hexdigest()


def repo_folder(cache: Path, repo_id: str) -> Path:
    return cache / ("models--" + repo_id.replace("/", "--"))


def put_in_cache(cache: Path, repo_id: str, files: dict[str, bytes], commit: str = COMMIT) -> Path:
    """`files` as `hf_hub_download` leaves them in the hub cache `cache`: the content in blobs/<sha256>, a relative
    symlink to it in snapshots/<commit>/<name>, and refs/main naming the commit. Returns the snapshot directory."""
    repo = repo_folder(cache, repo_id)
    snapshot = repo / "snapshots" / commit
    for name, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot


def read_folder(folder: Path) -> dict[str, bytes]:
    return {
        p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
    }


def closed_port_url() -> str:
    """An http URL on this machine where nothing listens (connections are refused at once)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@dataclass
class FakeHub:
    """The few hub routes snapshot_download uses (model info, tree listing, file HEAD and GET), for repos held in
    memory; `gated` repos answer metadata but refuse files, as the hub does. `requests` records every call."""

    repos: dict[str, dict[str, bytes]] = field(default_factory=dict)
    gated: set[str] = field(default_factory=set)
    requests: list[str] = field(default_factory=list)

    def handle(self, request: httpx2.Request) -> httpx2.Response:
        self.requests.append(f"{request.method} {request.url.path}")
        path = request.url.path
        api = path.startswith("/api/models/")
        parts = path.removeprefix("/api/models/").split("/") if api else path.lstrip("/").split("/")
        repo_id = "/".join(parts[:2])
        if repo_id not in self.repos:
            return httpx2.Response(
                404, headers={"X-Error-Code": "RepoNotFound"}, json={"error": "Repository not found"}
            )
        files = self.repos[repo_id]
        if api and (len(parts) == 2 or parts[2] == "revision"):  # /api/models/org/name[/revision/<rev>]
            siblings = [{"rfilename": name} for name in files]
            return httpx2.Response(200, json={"id": repo_id, "sha": COMMIT, "siblings": siblings})
        if api and parts[2] == "tree":  # /api/models/org/name/tree/<rev>
            tree = [{"type": "file", "path": n, "size": len(d), "oid": _oid(d)} for n, d in files.items()]
            return httpx2.Response(200, json=tree)
        # /org/name/resolve/<rev>/<file>
        if repo_id in self.gated:
            message = "Access to model is restricted. You must have access to it and be authenticated."
            return httpx2.Response(401, headers={"X-Error-Code": "GatedRepo", "X-Error-Message": message})
        name = "/".join(parts[4:])
        if name not in files:
            return httpx2.Response(404, headers={"X-Error-Code": "EntryNotFound"})
        data = files[name]
        headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{_oid(data)}"', "Content-Length": str(len(data))}
        return httpx2.Response(200, headers=headers, content=b"" if request.method == "HEAD" else data)

    @contextlib.contextmanager
    def serving(self) -> Iterator[FakeHub]:
        """huggingface_hub's HTTP client answered by this fake, whatever the endpoint, while the block runs."""
        previous = _http._GLOBAL_CLIENT_FACTORY
        huggingface_hub.set_client_factory(lambda: httpx2.Client(transport=httpx2.MockTransport(self.handle)))
        try:
            yield self
        finally:
            huggingface_hub.set_client_factory(previous)


@contextlib.contextmanager
def real_http_client() -> Iterator[None]:
    """huggingface_hub's own HTTP client while the block runs (for a test that must open real sockets)."""
    previous = _http._GLOBAL_CLIENT_FACTORY
    huggingface_hub.set_client_factory(_http.default_client_factory)
    try:
        yield
    finally:
        huggingface_hub.set_client_factory(previous)


def _oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()  # git's blob id
