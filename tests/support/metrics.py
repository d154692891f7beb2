"""Reading Prometheus metrics in tests: one sample's value, the metric types exposed, and scrapes of a
daemon's endpoint (``scrape_when`` retries until the text passes a check)."""

from __future__ import annotations

import re
import urllib.error
import urllib.request

from support.ring import Ring


def sample_value(text: str, sample: str) -> float | None:
    """The value of one sample line (``name{labels}`` exactly as exposed), or None."""
    m = re.search(rf"^{re.escape(sample)} (\S+)$", text, re.M)
    return None if m is None else float(m.group(1))


def metric_types(text: str) -> set[str]:
    return set(re.findall(r"^# TYPE (\S+) ", text, re.M))


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
        return r.read().decode()


def scrape_when(ring: Ring, port: int, check) -> str:
    """The first scrape of ``port`` for which ``check(text)`` holds (the daemon may not serve yet)."""
    def attempt():
        try:
            text = scrape(port)
        except (urllib.error.URLError, ConnectionError):
            return None
        return check(text) and text
    return ring.poll(attempt, timeout=60, what="a scrape that passes")
