"""Resumable, checked downloads for ``elmo pull`` (standard library HTTP, a tqdm bar). Torch-free.

- **Resume**: bytes arrive in ``FILE.part``; a transfer that breaks off keeps them, and the next attempt (in the same
  run, ``retries`` times, or a later run of the same command) asks for the rest with ``Range: bytes=N-``. A server
  that ignores the range (200 instead of 206) is read from the start again.
- **Size**: the size the catalogue lists, else the size pinned by the first download, must be the size the server
  announces (Content-Length / Content-Range) and the size on disk at the end; a shorter (truncated) or longer file
  is refused before anything reads it.
- **Published checksums**: a file whose SHA-256 the catalogue pins (found at its publisher or in a mirror's Git LFS
  pointer) must have it, on its first download as on every later one and every reuse of the cached copy; a file that
  does not is refused and removed (the partial download included): nothing of it is kept or imported.
- **Pins**: a file the catalogue has no checksum for is trusted on first use: its first complete download records its
  SHA-256 and size in the pins file (JSON, keyed by ``NAME/FILE``, so a mirror's copy is checked against the same
  pin); every later download, and every reuse of the cached file, must match it. A file that does not is removed and
  refused: it is never imported.

- **Bounds**: bytes are counted as they arrive, and the transfer stops at the size the catalogue or the pin gives,
  else at ``max_bytes`` (``elmo pull --max-download-bytes``, default DEFAULT_MAX_DOWNLOAD_BYTES): a server that
  sends more, or sends without end and no Content-Length, is cut off and its bytes removed.
- **Redirects** stay on the origin asked (the same host and port; http may become https), so a mirror or a
  publisher cannot hand the download, and its pin, to another host.

Every refusal is a DataError (one line, ``elmo pull: error: ...``, exit status 2).
"""

from __future__ import annotations

import contextlib
import fcntl
import http.client
import json
import os
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from elmo.errors import DataError
from elmo.runtime.modeldir import sha256_of

CHUNK = 1 << 16
TIMEOUT_S = 60.0
USER_AGENT = "elmo-pull/1 (+https://github.com/allenai/bilm-tf compatible importer)"
PART_SUFFIX = ".part"
CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")
DEFAULT_MAX_DOWNLOAD_BYTES = 2 << 30  # a file of unknown size: the largest published ELMo weights are 374 MB


class Pins:
    """The pins file: ``{"NAME/FILE": {"sha256": ..., "bytes": ..., "url": ..., "pinned_at": ...}}``."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.entries: dict[str, dict] = {}
        if self.path.is_file():
            try:
                data = json.loads(self.path.read_text())
            except (OSError, ValueError) as exc:
                raise DataError(f"{self.path}: unreadable pins file ({exc}); fix or remove it") from None
            if not isinstance(data, dict) or not all(isinstance(v, dict) and "sha256" in v for v in data.values()):
                raise DataError(f"{self.path}: not a pins file (NAME/FILE -> {{sha256, bytes}}); fix or remove it")
            self.entries = data

    def get(self, key: str) -> dict | None:
        return self.entries.get(key)

    def forget(self, key: str) -> None:
        self._update(key, None)

    def record(self, key: str, sha256: str, size: int, url: str) -> None:
        pin = {
            "sha256": sha256,
            "bytes": size,
            "url": url,
            "pinned_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        self._update(key, pin)

    def _update(self, key: str, pin: dict | None) -> None:
        """Set (or with None remove) one pin: under a lock, the file re-read first, so that pulls of other models at
        the same time keep theirs."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_name(f".{self.path.name}.lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            self.entries = {**Pins(self.path).entries, **self.entries}
            if pin is None:
                self.entries.pop(key, None)
            else:
                self.entries[key] = pin
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(self.entries, indent=2, sort_keys=True) + "\n")
            os.replace(tmp, self.path)


@dataclass
class Fetched:
    """One file in the download cache, checked: ``pinned`` is "published" (the catalogue's SHA-256), "recorded"
    (trusted on first download) or "verified" (against the pin its first download recorded)."""

    key: str
    path: Path
    url: str
    sha256: str
    size: int
    pinned: str
    downloaded: bool


class _Interrupted(Exception):
    """The transfer broke off (network error, early close): the .part file keeps what arrived."""


def _expected(size: int | None, pin: dict | None) -> tuple[int | None, str]:
    if size is not None:
        return size, "the catalogue lists"
    if pin is not None and isinstance(pin.get("bytes"), int):
        return pin["bytes"], "the pin recorded on first download says"
    return None, ""


def fetch(
    url: str,
    dest: Path,
    key: str,
    pins: Pins,
    size: int | None = None,
    retries: int = 3,
    progress: bool = True,
    retry_wait_s: float = 1.0,
    max_bytes: int = DEFAULT_MAX_DOWNLOAD_BYTES,
    sha256: str | None = None,
) -> Fetched:
    """``dest`` complete and checked (size; SHA-256 against ``sha256``, the published checksum, else against the pin,
    recorded when there is none yet): reused when already in the cache, else downloaded (resuming ``dest.part``),
    never more than its known size or ``max_bytes``. Raises DataError on a refusal, and when another process is
    fetching the same file (``dest.lock``)."""
    dest = Path(dest)
    if max_bytes < 1:
        raise DataError(f"the download cap must be at least 1 byte (got {max_bytes})")
    with _locked(dest):
        return _fetch(url, dest, key, pins, size, retries, progress, retry_wait_s, max_bytes, sha256)


@contextlib.contextmanager
def _locked(dest: Path):
    dest.parent.mkdir(parents=True, exist_ok=True)
    lock_path = dest.with_name(dest.name + ".lock")
    with open(lock_path, "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DataError(
                f"{dest}: another elmo pull is fetching this file now ({lock_path}); let it finish, "
                "then run this command again (it reuses the file)"
            ) from None
        yield


def _fetch(
    url: str,
    dest: Path,
    key: str,
    pins: Pins,
    size: int | None,
    retries: int,
    progress: bool,
    retry_wait_s: float,
    max_bytes: int,
    published: str | None,
) -> Fetched:
    pin = None if published is not None else pins.get(key)  # a published checksum outranks a pin of one's own
    expected, why = _expected(size, pin)
    cap = Cap(expected, why) if expected is not None else Cap(max_bytes, "the download cap (--max-download-bytes) is")
    downloaded = False
    if not dest.is_file():
        dest.parent.mkdir(parents=True, exist_ok=True)
        part = dest.with_name(dest.name + PART_SUFFIX)
        for attempt in range(retries + 1):
            try:
                _transfer(url, part, expected, why, progress, cap)
                break
            except _Interrupted as exc:
                have = part.stat().st_size if part.is_file() else 0
                of = f" of {expected:,}" if expected else ""
                if attempt == retries:
                    raise DataError(
                        f"{url}: the transfer broke off at {have:,}{of} bytes ({exc}); what arrived is kept in "
                        f"{part}: run the same command again to resume"
                    ) from None
                time.sleep(retry_wait_s * 2**attempt)
        _check_size(part, expected, why, url)
        digest = sha256_of(part)
        if published is not None:  # checked before it takes the file's name: a tampered file never has it
            _check_published(part, digest, published, url, key)
        os.replace(part, dest)
        downloaded = True
    else:
        _check_size(dest, expected, why, url, cached=True)
        digest = sha256_of(dest)
        if published is not None:
            _check_published(dest, digest, published, url, key)
    actual = dest.stat().st_size
    if published is not None:
        return Fetched(key, dest, url, digest, actual, "published", downloaded)
    if pin is None:
        pins.record(key, digest, actual, url)
        return Fetched(key, dest, url, digest, actual, "recorded", downloaded)
    if digest != pin["sha256"]:
        dest.unlink()
        raise DataError(
            f"{dest.name}: sha256 {digest} differs from the pin {pin['sha256']} recorded on first download "
            f"({pins.path}, key {key}): refused and removed, not imported (if the publisher really replaced the "
            "file, delete that key from the pins file)"
        )
    return Fetched(key, dest, url, digest, actual, "verified", downloaded)


def _check_published(path: Path, digest: str, published: str, url: str, key: str) -> None:
    """Refuse (and remove) ``path``, whose SHA-256 is ``digest``, unless that is the one the catalogue pins."""
    if digest == published:
        return
    path.unlink()
    raise DataError(
        f"{url}: sha256 {digest} differs from the published {published} the catalogue pins for {key}: "
        "refused and removed, nothing kept or imported (a tampered or corrupted download)"
    )


def _check_size(path: Path, expected: int | None, why: str, url: str, cached: bool = False) -> None:
    actual = path.stat().st_size
    if expected is None or actual == expected:
        return
    path.unlink()
    what = "truncated" if actual < expected else "too long"
    where = f"the cached {path}" if cached else f"{url}"
    raise DataError(f"{where}: {what}: {actual:,} bytes, {why} {expected:,}: refused and removed, not imported")


@dataclass(frozen=True)
class Cap:
    """The most bytes a file may have, and why (for the message)."""

    bytes: int
    why: str

    def refuse(self, url: str, part: Path) -> DataError:
        part.unlink(missing_ok=True)
        return DataError(
            f"{url}: the server sent more than {self.bytes:,} bytes, {self.why} {self.bytes:,}: "
            "refused and cut off, the partial download removed, nothing imported"
        )


class _SameOrigin(urllib.request.HTTPRedirectHandler):
    """Follow a redirect only to the origin asked (same host and port; http -> https allowed)."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        asked, told = urllib.parse.urlsplit(req.full_url), urllib.parse.urlsplit(newurl)
        upgrade = (asked.scheme, told.scheme) in (("http", "https"), ("http", "http"), ("https", "https"))
        if not upgrade or (asked.hostname, _port(asked)) != (told.hostname, _port(told, asked)):
            raise DataError(
                f"{req.full_url}: HTTP {code} redirect to another origin ({newurl}): refused (pull from "
                "the publisher's address or --base-url directly)"
            )
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _port(parts: urllib.parse.SplitResult, asked: urllib.parse.SplitResult | None = None) -> int | None:
    """The port, the scheme's default filled in (an http -> https upgrade on default ports keeps "the same port")."""
    if parts.port is not None:
        return parts.port
    if asked is not None and asked.port is None:
        return _port(asked)
    return {"http": 80, "https": 443}.get(parts.scheme)


def _transfer(url: str, part: Path, expected: int | None, why: str, progress: bool, cap: Cap) -> None:
    """One attempt: append the rest of ``url`` to ``part`` (Range from its size), or start over on a 200; never
    past ``cap``."""
    offset = part.stat().st_size if part.is_file() else 0
    if expected is not None and offset >= expected:
        if offset == expected:
            return  # already whole: the size and pin checks decide
        part.unlink()
        offset = 0
    headers = {"User-Agent": USER_AGENT}
    if offset:
        headers["Range"] = f"bytes={offset}-"
    try:
        opener = urllib.request.build_opener(_SameOrigin)  # per call: the proxy settings of the environment now
        response = opener.open(urllib.request.Request(url, headers=headers), timeout=TIMEOUT_S)
    except urllib.error.HTTPError as exc:
        if exc.code == 416 and offset:
            if expected is None:
                return  # nothing after the offset: the part is the whole file (the pin decides)
            part.unlink()
            raise DataError(
                f"{url}: the server's file is shorter than the {offset:,} bytes already downloaded, "
                f"{why} {expected:,} (HTTP 416): refused; the partial download was removed"
            ) from None
        raise DataError(f"{url}: HTTP {exc.code} {exc.reason}") from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
        raise _Interrupted(f"{getattr(exc, 'reason', exc)}") from None
    with response:
        total = _announced_total(response, offset, url)
        if response.status != 206:
            offset = 0  # the whole file again: the server ignored (or does not support) the range
        if expected is not None and total is not None and total != expected:
            raise DataError(
                f"{url}: the server offers {total:,} bytes, {why} {expected:,}: refused (a truncated or different "
                "file), nothing imported"
            )
        if total is not None and total > cap.bytes:
            raise DataError(
                f"{url}: the server offers {total:,} bytes, {cap.why} {cap.bytes:,}: refused before downloading"
            )
        with (
            open(part, "ab" if offset else "wb") as out,
            tqdm(
                total=total,
                initial=offset,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                desc=part.name[:-5],
                disable=None if progress else True,
                leave=False,
            ) as bar,
        ):
            have = offset
            while True:
                try:
                    block = response.read(CHUNK)
                except (http.client.HTTPException, OSError) as exc:
                    raise _Interrupted(type(exc).__name__) from None
                if not block:
                    break
                have += len(block)
                if have > cap.bytes:  # counted as it arrives: no Content-Length, or one that lies
                    out.close()
                    raise cap.refuse(url, part)
                out.write(block)
                bar.update(len(block))
    have = part.stat().st_size
    if total is not None and have < total:
        raise _Interrupted("the connection closed early")


def _announced_total(response, offset: int, url: str) -> int | None:
    """The whole file's size as the server announces it (None when it does not say)."""
    if response.status == 206:
        match = CONTENT_RANGE.fullmatch(response.headers.get("Content-Range", "").strip())
        if not match or int(match.group(1)) != offset:
            raise DataError(
                f"{url}: the server answered the range request from byte {offset:,} with Content-Range "
                f"{response.headers.get('Content-Range')!r}"
            )
        return None if match.group(3) == "*" else int(match.group(3))
    length = response.headers.get("Content-Length")
    return int(length) if length and length.isascii() and length.isdigit() else None  # "²".isdigit() is True
