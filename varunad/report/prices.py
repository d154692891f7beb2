"""What a device-hour costs, at spot and at on-demand prices, per device kind.

A device is one slot (one GPU, or one CPU-only VM: a CPU host offers one slot). The default
table below holds approximate public list prices in US dollars per device-hour, for Linux VMs in
AWS us-east-1; spot prices move hourly and by zone, so they are typical figures, not quotes.
Sources (one VM type per kind, its price divided by its devices):

    cpu    c5.2xlarge (8 vCPU): on-demand $0.34/h, spot $0.17-0.19/h by zone; AWS EC2 Auto
           Scaling user guide, "Spot price per unit hour example" (example pricing).
    v100   p3.2xlarge (1 V100): on-demand $3.06/h (AWS EC2 on-demand list price); spot taken
           as on-demand / 4.5, the middle of the "4-5x cheaper" the Varuna paper (EuroSys 2022)
           reports for low-priority VMs.
    cuda   a GPU of unknown model (the daemon's default kind on a GPU host): priced as a V100.
    a100   p4d.24xlarge (8 A100 40 GB): on-demand $32.77/h (2023 list) = $4.10 per GPU; spot
           = on-demand / 4.5, as above.
    h100   p5.48xlarge (8 H100): on-demand $98.32/h (2023 list; AWS cut P5 prices in 2024)
           = $12.29 per GPU; spot = on-demand / 4.5, as above.

Daemons name a GPU host's kind by its model ("NVIDIA A100-SXM4-80GB"): ``price_of`` prices it
by the family it names (a100), and a CPU slot of a host running n workers ("cpu-<n>slots") at
the host's price divided by n. Override or extend with ``varunactl report JOB --prices FILE``, a JSON object of
``{"<device kind>": {"spot": <$/h>, "on_demand": <$/h>, "source": "<optional note>"}}``; kinds
the file names replace the defaults, the others stay.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["PriceError", "DevicePrice", "DEFAULT_PRICES", "load_prices", "parse_prices", "price_of"]


class PriceError(ValueError):
    """A price table that cannot be used, with the reason and the expected form."""


@dataclass(frozen=True, slots=True)
class DevicePrice:
    spot: float  # $ per device-hour
    on_demand: float
    source: str = ""

    def __post_init__(self) -> None:
        for name in ("spot", "on_demand"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise PriceError(f"{name} must be a number of dollars per device-hour >= 0, got {value!r}")


_SPOT_DISCOUNT = 4.5  # on-demand / spot where no spot figure is published (see the docstring)


def _gpu(on_demand: float, source: str) -> DevicePrice:
    return DevicePrice(round(on_demand / _SPOT_DISCOUNT, 3), on_demand, f"{source}; spot = on-demand / 4.5")


DEFAULT_PRICES: Mapping[str, DevicePrice] = {
    "cpu": DevicePrice(0.18, 0.34, "c5.2xlarge, AWS EC2 Auto Scaling guide example pricing"),
    "v100": _gpu(3.06, "p3.2xlarge, AWS us-east-1 list price"),
    "cuda": _gpu(3.06, "unknown GPU model, priced as a V100 (p3.2xlarge)"),
    "a100": _gpu(4.10, "p4d.24xlarge / 8, AWS us-east-1 list price 2023"),
    "h100": _gpu(12.29, "p5.48xlarge / 8, AWS us-east-1 list price 2023"),
}

_FORM = 'expected {"<device kind>": {"spot": <$/h>, "on_demand": <$/h>}, ...}'


def parse_prices(doc: Any, *, where: str = "the price table") -> dict[str, DevicePrice]:
    """The kinds of a decoded JSON price table; PriceError naming the first bad entry."""
    if not isinstance(doc, dict) or not doc:
        raise PriceError(f"{where} is not a non-empty JSON object; {_FORM}")
    out = {}
    for kind, entry in doc.items():
        if not isinstance(entry, dict) or not {"spot", "on_demand"} <= set(entry):
            raise PriceError(f"{where}: {kind!r} needs both 'spot' and 'on_demand'; {_FORM}")
        unknown = sorted(set(entry) - {"spot", "on_demand", "source"})
        if unknown:
            raise PriceError(f"{where}: {kind!r} has unknown fields {unknown}; {_FORM}")
        try:
            out[str(kind)] = DevicePrice(entry["spot"], entry["on_demand"], str(entry.get("source", where)))
        except PriceError as exc:
            raise PriceError(f"{where}: {kind!r}: {exc}") from None
    return out


def load_prices(path: str | os.PathLike[str] | None = None) -> dict[str, DevicePrice]:
    """The default table, with the kinds in the JSON file at `path` (if any) replacing theirs."""
    table = dict(DEFAULT_PRICES)
    if path is None:
        return table
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except OSError as exc:
        raise PriceError(f"cannot read the price file {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise PriceError(f"the price file {path} is not JSON: {exc}") from None
    table.update(parse_prices(doc, where=f"price file {path}"))
    return table


_CPU_SLOTS = re.compile(r"(?P<host>.+)-(?P<n>[1-9][0-9]*)slots")


def price_of(prices: Mapping[str, DevicePrice], kind: str) -> DevicePrice | None:
    """The price of one slot of `kind`: its own entry, else the family its name contains (as a
    word: 'a100' prices 'NVIDIA A100-SXM4-80GB', the longest such name winning), else for
    '<kind>-<n>slots' the host's price shared by its n slots; None when nothing matches."""
    if kind in prices:
        return prices[kind]
    shared = _CPU_SLOTS.fullmatch(kind)
    if shared:
        host, n = price_of(prices, shared["host"]), int(shared["n"])
        return host and DevicePrice(host.spot / n, host.on_demand / n, f"{host.source}; shared by {n} slots")
    words = set(re.findall(r"[a-z0-9]+", kind.lower()))
    families = [k for k in prices if k.lower() in words]
    return prices[max(families, key=len)] if families else None
