"""The one way a user's text file is read: UTF-8, or one clear error naming the file, the line and what to do.

Chinese text often arrives as GBK / GB18030 and Windows text as CP1252; a bare UnicodeDecodeError would name
neither the file nor the way out.
"""

from __future__ import annotations

from pathlib import Path

from elmo.errors import DataError


def read_user_text(path: str | Path, what: str = "text file") -> str:
    """The whole file as text; DataError (not UnicodeDecodeError) when it is missing or not UTF-8."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: {what} not found")
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise DataError(
            f"{path}: not UTF-8 (byte 0x{data[exc.start]:02x} on line {line}); convert it first, e.g. "
            f"`iconv -f GB18030 -t UTF-8 {path} > {path.stem}.utf8{path.suffix}` for Chinese text"
        ) from None


def read_user_lines(path: str | Path, what: str = "text file") -> list[str]:
    """The file's lines (any line ending), as read_user_text reads the file."""
    return read_user_text(path, what).splitlines()
