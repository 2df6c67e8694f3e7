"""A loopback Hugging Face Hub: :class:`HubServer` serves repositories from local directories
with the Hub's file API, from a thread of this process.

What it answers, as the Hub does (``HF_ENDPOINT`` pointed at :attr:`HubServer.endpoint_url`
makes huggingface_hub, and so ``hf://`` URLs, use it):

- ``GET /api/{datasets,models}/OWNER/NAME[/revision/REV]``: the repository's info (``id``, ``sha``);
- ``GET /api/{datasets,models}/OWNER/NAME/tree/REV[/PATH][?recursive=true]``: a directory's
  entries as JSON (``type``, ``path``, ``size``, ``oid``), ``page_size`` per page, further pages
  named by a ``Link: <...>; rel="next"`` header (a cursor), as the Hub paginates;
- ``GET``/``HEAD /[datasets/]OWNER/NAME/resolve/REV/PATH``: the file, single byte ranges (206,
  416 past the end); with ``redirect=True`` a 302 to ``/cdn/...``, which serves the same bytes
  without asking for the token, as the Hub's CDN does (``redirect=other_server``: to that
  server's ``/cdn/...``, another origin);
- a revision with slashes is read quoted (``refs%2Fconvert%2Fparquet``) or plain;
- with ``token`` set, every request but the CDN's must carry ``Authorization: Bearer TOKEN``
  (else 401, ``X-Error-Code: RepoNotFound``, as the Hub hides a private repository);
- :meth:`HubServer.throttle` answers the next resolve requests 429 with a ``Retry-After``.

Every request is logged (:attr:`HubServer.requests`: time, method, path, kind, the token's
presence): tests count listings and measure the rate of resolve requests at the server.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import threading
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from streamdata.testing._process import _POLL_S, _STOP_TIMEOUT_S, ServerError, _Managed
from streamdata.testing.http import _RangeRequestHandler, _ThreadedHTTPServer

__all__ = ["HubRequest", "HubServer"]

_TYPES = {"datasets": "dataset", "models": "model"}


@dataclass(frozen=True)
class HubRequest:
    """One request as the server saw it. ``kind``: ``"info"`` (a repository's), ``"tree"``,
    ``"resolve"``, ``"cdn"`` or ``"other"`` (huggingface_hub's own calls, answered 404);
    ``answer``: the status sent."""

    at: float  # time.monotonic()
    method: str
    path: str
    kind: str
    authorized: bool
    answer: int
    bearer: bool = False  # an Authorization header came, whatever its token


class _HubHandler(_RangeRequestHandler):
    server: _HubHTTPServer

    def do_GET(self) -> None:
        self._hub(send_body=True)

    def do_HEAD(self) -> None:
        self._hub(send_body=False)

    def _answer(self, kind: str, status: int) -> None:
        self.server.log_request(HubRequest(time.monotonic(), self.command, self.path, kind,
                                           self._authorized(), status,
                                           self.headers.get("Authorization") is not None))

    def _authorized(self) -> bool:
        token = self.server.owner.token
        return token is None or self.headers.get("Authorization") == f"Bearer {token}"

    def _json(self, status: int, body: Any, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _error(self, status: int, code: str, message: str, headers: dict[str, str] | None = None) -> None:
        self._json(status, {"error": message}, {"X-Error-Code": code, **(headers or {})})

    def _hub(self, send_body: bool) -> None:
        owner = self.server.owner
        if owner.latency > 0:
            time.sleep(owner.latency)
        url = urllib.parse.urlsplit(self.path)
        parts = urllib.parse.unquote(url.path).strip("/").split("/")
        if parts[:1] == ["cdn"]:
            self._answer("cdn", self._file(owner.cdn.get("/".join(parts[1:])), send_body))
            return
        kind = "info" if parts[:1] == ["api"] and parts[1:2] in (["datasets"], ["models"]) else "other"
        if kind == "info" and "tree" in parts:
            kind = "tree"
        elif kind == "other" and parts[:1] != ["api"] and "resolve" in parts:
            kind = "resolve"
        if not self._authorized():
            self._error(401, "RepoNotFound", "Repository not found or the token is invalid")
            self._answer(kind, 401)
            return
        if kind == "resolve" and owner.take_throttle():
            self._error(429, "RateLimited", "rate limited", {"Retry-After": str(owner.retry_after)})
            self._answer(kind, 429)
            return
        if kind == "resolve":
            self._answer(kind, self._resolve(parts, send_body))
        elif kind in ("info", "tree"):
            self._answer(kind, self._api(parts[1:], urllib.parse.parse_qs(url.query)))
        else:
            self._error(404, "EntryNotFound", "no such route")
            self._answer(kind, 404)

    def _repo(self, parts: list[str]) -> tuple[str | None, list[str]]:
        """``(repository key, what follows it)`` of ``[datasets/]OWNER/NAME/...``."""
        if parts[:1] == ["datasets"]:
            return f"datasets/{'/'.join(parts[1:3])}", parts[3:]
        if parts[:1] == ["models"]:
            return "/".join(parts[1:3]), parts[3:]
        return "/".join(parts[:2]), parts[2:]

    def _revision(self, repo: str, rest: list[str]) -> tuple[Path | None, str | None, list[str]]:
        """The directory of the revision ``rest`` starts with (plain or quoted), its name, what follows."""
        revisions = self.server.owner.repos.get(repo, {})
        for name in sorted(revisions, key=len, reverse=True):
            count = name.count("/") + 1
            if "/".join(rest[:count]) == name:
                return revisions[name], name, rest[count:]
        return None, None, rest

    def _resolve(self, parts: list[str], send_body: bool) -> int:
        repo, rest = self._repo(parts)
        if repo is None or rest[:1] != ["resolve"]:
            self._error(404, "RepoNotFound", "Repository not found")
            return 404
        root, revision, rest = self._revision(repo, rest[1:])
        if root is None:
            self._error(404, "RevisionNotFound", "Invalid rev id")
            return 404
        path = (root / "/".join(rest)).resolve()
        if not path.is_file() or root.resolve() not in path.parents:
            self._error(404, "EntryNotFound", "Entry not found")
            return 404
        owner = self.server.owner
        if owner.redirect:
            cdn = owner.redirect if isinstance(owner.redirect, HubServer) else owner
            key = hashlib.sha256(str(path).encode()).hexdigest()[:16] + "/" + path.name
            cdn.cdn[key] = path
            self.send_response(302)
            self.send_header("Location", f"{cdn.endpoint_url if cdn is not owner else ''}/cdn/{key}")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return 302
        return self._file(path, send_body)

    def _file(self, path: Path | None, send_body: bool) -> int:
        if path is None:
            self._error(404, "EntryNotFound", "Entry not found")
            return 404
        with open(path, "rb") as file:
            self._send_file(file, "application/octet-stream", send_body)
        size = path.stat().st_size
        span = self.headers.get("Range")
        return 206 if span and span.startswith("bytes=") and size else 200

    def _api(self, parts: list[str], query: dict[str, list[str]]) -> int:
        if parts[:1] not in (["datasets"], ["models"]):
            self._error(404, "RepoNotFound", "Repository not found")
            return 404
        repo, rest = self._repo(parts)
        revisions = self.server.owner.repos.get(repo or "")
        if not revisions:
            self._error(404, "RepoNotFound", "Repository not found")
            return 404
        if not rest or rest[:1] == ["revision"]:
            root, name, _ = self._revision(repo or "", rest[1:] if rest else ["main"])
            if root is None:
                self._error(404, "RevisionNotFound", "Invalid rev id")
                return 404
            sha = hashlib.sha1(f"{repo}@{name}".encode()).hexdigest()
            self._json(200, {"id": repo.removeprefix("datasets/") if repo else repo, "sha": sha,
                             "private": self.server.owner.token is not None})
            return 200
        if rest[:1] != ["tree"]:
            self._error(404, "EntryNotFound", "no such route")
            return 404
        root, _, rest = self._revision(repo or "", rest[1:])
        if root is None:
            self._error(404, "RevisionNotFound", "Invalid rev id")
            return 404
        where = root.joinpath(*rest) if rest else root
        if not where.is_dir():
            self._error(404, "EntryNotFound", f"{'/'.join(rest)} does not exist")
            return 404
        recursive = (query.get("recursive") or ["false"])[0].lower() == "true"
        entries = _entries(root, where, recursive)
        cursor = int((query.get("cursor") or ["0"])[0])
        size = self.server.owner.page_size
        page = entries[cursor: cursor + size]
        headers = {}
        if cursor + size < len(entries):
            nxt = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(self.path).query))
            nxt["cursor"] = str(cursor + size)
            link = f"{self.server.owner.endpoint_url}{urllib.parse.urlsplit(self.path).path}?" \
                   f"{urllib.parse.urlencode(nxt)}"
            headers["Link"] = f'<{link}>; rel="next"'
        self._json(200, page, headers)
        return 200


def _entries(root: Path, where: Path, recursive: bool) -> list[dict[str, Any]]:
    """The tree API's entries under ``where`` (directories first, then files, each by path)."""
    found: list[dict[str, Any]] = []
    for dirpath, dirnames, filenames in os.walk(where):
        dirnames.sort()
        here = Path(dirpath)
        for name in dirnames:
            rel = (here / name).relative_to(root).as_posix()
            found.append({"type": "directory", "oid": hashlib.sha1(rel.encode()).hexdigest(), "path": rel})
        for name in sorted(filenames):
            path = here / name
            rel = path.relative_to(root).as_posix()
            found.append({"type": "file", "oid": hashlib.sha1(rel.encode()).hexdigest(),
                          "size": path.stat().st_size, "path": rel})
        if not recursive:
            break
    return sorted(found, key=lambda e: (e["type"] != "directory", e["path"]))


class _HubHTTPServer(_ThreadedHTTPServer):
    owner: HubServer

    def log_request(self, request: HubRequest) -> None:
        with self._lock:
            self.owner._log.append(request)


class HubServer(_Managed):
    """A Hugging Face Hub on 127.0.0.1 (see the module's docstring), serving the repositories
    :meth:`add` names from local directories.

    ``token``: the one every request must carry (``None``: any, or none); ``redirect``: resolve
    answers a 302 to the server's CDN path (``True``) or another ``HubServer``'s; ``page_size``:
    entries per page of a tree listing; ``latency``: seconds slept per request.
    """

    def __init__(self, *, token: str | None = None, redirect: bool | HubServer = False, page_size: int = 1000,
                 latency: float = 0.0, host: str = "127.0.0.1", port: int | None = None) -> None:
        self.token, self.redirect, self.page_size, self.latency = token, redirect, page_size, latency
        self.host, self.port = host, port
        self.repos: dict[str, dict[str, Path]] = {}
        self.cdn: dict[str, Path] = {}
        self.retry_after = 1
        self._throttled = 0
        self._log: list[HubRequest] = []
        self._lock = threading.Lock()
        self._server: _HubHTTPServer | None = None
        self._thread: threading.Thread | None = None

    def add(self, repo_id: str, directory: str | os.PathLike[str], *, revision: str = "main",
            repo_type: str = "dataset") -> HubServer:
        """Serve ``directory`` as ``revision`` of ``repo_id`` (``OWNER/NAME``)."""
        key = f"datasets/{repo_id}" if repo_type == "dataset" else repo_id
        self.repos.setdefault(key, {})[revision] = Path(directory)
        return self

    @property
    def endpoint_url(self) -> str:
        if self.port is None:
            raise ServerError("HubServer is not started")
        return f"http://{self.host}:{self.port}"

    @property
    def requests(self) -> list[HubRequest]:
        with self._lock:
            return list(self._log)

    def clear(self) -> None:
        """Forget the requests logged so far."""
        with self._lock:
            self._log.clear()

    def throttle(self, count: int, retry_after: int = 1) -> None:
        """Answer the next ``count`` resolve requests 429, asking for ``retry_after`` seconds."""
        with self._lock:
            self._throttled, self.retry_after = count, retry_after

    def take_throttle(self) -> bool:
        with self._lock:
            if self._throttled <= 0:
                return False
            self._throttled -= 1
            return True

    def start(self) -> HubServer:
        if self._server is not None:
            return self
        handler = functools.partial(_HubHandler, directory=os.devnull)
        self._server = _HubHTTPServer((self.host, self.port or 0), handler, 0.0)
        self._server.owner = self
        self._server._lock = self._lock  # one lock for the log and the throttle
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever, args=(_POLL_S,),
                                        name="streamdata-testing-hub", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is None or self._thread is None:
            return
        self._server.shutdown()
        self._thread.join(_STOP_TIMEOUT_S)
        self._server.server_close()
        self._server.close_connections(_STOP_TIMEOUT_S)
        self._server = self._thread = None

    def __repr__(self) -> str:
        return f"HubServer(repos={sorted(self.repos)}, port={self.port})"
