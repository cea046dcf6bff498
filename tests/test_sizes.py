"""elmo.sizes: the one byte formatter, used by the service's messages, the batch job's summary and the catalogue."""

from __future__ import annotations

import pytest

from elmo.sizes import human_bytes


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 bytes"),
        (1023, "1023 bytes"),
        (1024, "1.0 KiB"),
        (1536, "1.5 KiB"),
        (64 << 20, "64.0 MiB"),
        (3 << 29, "1.5 GiB"),
    ],
)
def test_human_bytes(n, text):
    assert human_bytes(n) == text


def test_every_caller_formats_with_the_one_formatter(tmp_path):
    from elmo.service.common import limits

    from elmo.batch.job import _size
    from elmo.importers.catalogue import CATALOGUE
    from elmo.importers.catalogue import _size as catalogue_size

    assert limits.human_bytes is human_bytes
    (tmp_path / "part").write_bytes(b"x" * 3000)
    assert _size(tmp_path) == human_bytes(3000) == "2.9 KiB"
    known = CATALOGUE["original"].known_bytes
    assert catalogue_size(CATALOGUE["original"]).startswith(human_bytes(known))
