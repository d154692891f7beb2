"""systemd/varunad.service and systemd/varunad.env: the settings the issue asks for, and
`systemd-analyze verify` when the tool is installed."""

from __future__ import annotations

import configparser
import re

from support import REPO

from varunad.node.config import load_config, parse_env_file

SYSTEMD = REPO / "systemd"
UNIT = SYSTEMD / "varunad.service"
ENV = SYSTEMD / "varunad.env"


def _unit() -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None, comment_prefixes=("#", ";"))
    parser.optionxform = str  # systemd keys are case-sensitive
    parser.read(UNIT)
    return parser


def _seconds(text: str) -> float:
    total = 0.0
    for number, unit in re.findall(r"(\d+(?:\.\d+)?)\s*(min|s|ms|h)?", text):
        total += float(number) * {"ms": 0.001, "s": 1, "min": 60, "h": 3600, "": 1}[unit]
    return total


def test_unit_has_the_settings_a_preemptible_vm_needs():
    unit = _unit()
    assert "network-online.target" in unit["Unit"]["After"].split()
    assert "network-online.target" in unit["Unit"]["Wants"].split()
    service = unit["Service"]
    assert service["Restart"] == "on-failure"
    assert service["KillSignal"] == "SIGTERM"
    assert service["KillMode"] == "mixed"  # SIGTERM to the daemon only; it stops its workers itself
    assert service["EnvironmentFile"].endswith("varunad.env")
    assert service["ExecStart"].split()[0].endswith("/varunad")
    # workers run whatever script is submitted to the fleet: not as root
    assert service.get("User") not in (None, "", "root", "0") and service["NoNewPrivileges"] == "yes"
    # the stop timeout covers the workers' checkpoint grace with room to leave the fleet
    grace = float(parse_env_file(ENV)["VARUNAD_STOP_GRACE"])
    assert _seconds(service["TimeoutStopSec"]) >= grace + 30
    assert unit["Install"]["WantedBy"] == "multi-user.target"


def test_env_file_is_a_valid_configuration():
    env = parse_env_file(ENV)
    config = load_config([], environ=env)
    assert config.etcd and config.store and config.curve_keys and not config.plaintext
    assert config.loop_wait + 2 * config.retry_timeout <= config.ttl
    assert config.stop_grace == float(env["VARUNAD_STOP_GRACE"])
    # a file baked into every VM's image must not pin one VM's address
    assert "VARUNAD_ADVERTISE" not in env and config.advertise


