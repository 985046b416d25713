"""The store tests' fixtures: a progress database in the test's own directory, and the store's clock moved by hand."""
from __future__ import annotations

from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from batchrun.store import Store


@pytest.fixture
def db_path(tmp_path) -> Path:
    return tmp_path / "state" / "progress.db"


@pytest.fixture
def store(db_path):
    opened = Store(db_path)
    yield opened
    opened.close()


class Clock:
    """The store's clock, moved by hand: the times status reports then follow from the test, not from how fast the
    machine ran it."""

    def __init__(self):
        self.now = datetime.now(timezone.utc).replace(microsecond=0)  # the store keeps milliseconds: none lost

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)


@pytest.fixture
def clock(monkeypatch) -> Clock:
    current = Clock()

    class ClockedDatetime(datetime):
        @classmethod
        def now(cls, tz=None):
            return current.now.astimezone(tz) if tz is not None else current.now.replace(tzinfo=None)

    monkeypatch.setattr("batchrun.store.locks.datetime", ClockedDatetime)  # where the store's clock reads the time
    return current
