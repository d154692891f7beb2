"""Prometheus metrics (varunad.node.metrics): the registry and its exposition, the asyncio endpoint, and
a daemon that cannot serve them (tests/integration/test_daemon_single.py scrapes a real daemon running a job)."""

from __future__ import annotations

import asyncio

import pytest
from support.metrics import metric_types, sample_value

from trainer.launch import free_ports
from varunad.node.config import DaemonConfigError, load_config
from varunad.node.metrics import METRIC_NAMES, DaemonMetrics, MetricsError, serve

# -- the registry -----------------------------------------------------------------------------------

async def test_exposition_holds_every_documented_name_and_the_values_set():
    m = DaemonMetrics()
    m.members.set(3)
    m.leader.set(1)
    m.plan_epoch.set(42)
    m.workers.set(2)
    m.morphs.inc()
    m.begin_epoch({4: 1, 5: 1})
    m.worker_progress(job="gpt", rank=4, step=7, loss=2.5, samples_per_s=96.0, busy_fraction=0.75, reports_job=True)
    m.worker_progress(job="gpt", rank=5, step=7, loss=9.0, samples_per_s=1.0, busy_fraction=0.5, reports_job=False)
    text = (await m.exposition()).decode()
    assert set(METRIC_NAMES) <= metric_types(text)
    for sample, value in (("varunad_members", 3), ("varunad_leader", 1), ("varunad_plan_epoch", 42),
                          ("varunad_workers", 2), ("varunad_morphs_total", 1), ('varunad_job_step{job="gpt"}', 7),
                          ('varunad_job_loss{job="gpt"}', 2.5), ('varunad_samples_per_second{job="gpt"}', 96.0),
                          ('varunad_stage_busy_fraction{job="gpt",rank="4",stage="1"}', 0.75),
                          ('varunad_stage_busy_fraction{job="gpt",rank="5",stage="1"}', 0.5)):
        assert sample_value(text, sample) == value, sample
    m.begin_epoch({0: 0})  # ranks move between stages: old busy fractions go, the job's last step stays
    text = (await m.exposition()).decode()
    assert "varunad_stage_busy_fraction{" not in text and sample_value(text, 'varunad_job_step{job="gpt"}') == 7
    m.begin_epoch({0: 0}, "gpt")  # the same job's next epoch: its figures stay until new ones arrive
    assert sample_value((await m.exposition()).decode(), 'varunad_job_step{job="gpt"}') == 7
    m.begin_epoch({0: 0}, "bert")  # another job here: the old one's figures are no longer served
    text = (await m.exposition()).decode()
    assert 'job="gpt"' not in text.replace('varunad_checkpoint_seconds', '')
    m.worker_progress(job="bert", rank=0, step=1, loss=1.0, samples_per_s=5.0, busy_fraction=1.0, reports_job=True)
    m.forget_job("bert")
    m.forget_job("bert")  # twice is harmless
    assert 'varunad_job_step{' not in (await m.exposition()).decode()
    assert "varunad_members 0.0" in (await DaemonMetrics().exposition()).decode()  # registries are separate


async def test_checkpoint_seconds_are_the_stall_the_worker_reports():
    m = DaemonMetrics()
    m.worker_checkpointed(job="j", stalled_s=0.07)
    m.worker_checkpointed(job="j", stalled_s=0.01)
    text = (await m.exposition()).decode()
    assert sample_value(text, 'varunad_checkpoint_seconds_count{job="j"}') == 2
    assert sample_value(text, 'varunad_checkpoint_seconds_bucket{job="j",le="0.05"}') == 1
    assert sample_value(text, 'varunad_checkpoint_seconds_sum{job="j"}') == pytest.approx(0.08)


async def test_slot_slowdown_is_each_measured_slot_and_each_straggler_even_idle():
    m = DaemonMetrics()
    m.slot_paces({"d1/0": 1.0, "d2/0": 3.9}, {"d2/0": 3.9, "d9/0": 5.1})
    text = (await m.exposition()).decode()
    assert sample_value(text, 'varunad_slot_slowdown{slot="d1/0",straggler="0"}') == 1.0
    assert sample_value(text, 'varunad_slot_slowdown{slot="d2/0",straggler="1"}') == 3.9
    assert sample_value(text, 'varunad_slot_slowdown{slot="d9/0",straggler="1"}') == 5.1   # idle, its last figure
    m.slot_paces({"d1/0": 1.0}, {})   # a new epoch without d2, d9 no longer a straggler: their series go
    text = (await m.exposition()).decode()
    assert 'slot="d2/0"' not in text and 'slot="d9/0"' not in text


async def test_the_endpoint_answers_get_metrics_and_refreshes_first():
    m = DaemonMetrics()
    scrapes = []

    async def refresh() -> None:
        scrapes.append(1)
        m.members.set(len(scrapes))

    m.before_scrape = refresh
    port = free_ports(1)[0]
    server = await serve(m, "127.0.0.1", port)
    try:
        async def get(path: str, method: str = "GET") -> tuple[str, bytes]:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(f"{method} {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            data = await reader.read()
            writer.close()
            head, _, body = data.partition(b"\r\n\r\n")
            return head.decode().split("\r\n")[0], body

        status, body = await get("/metrics")
        assert status == "HTTP/1.1 200 OK" and b"varunad_members 1.0" in body
        assert (await get("/metrics?x=1"))[1].count(b"varunad_members 2.0") == 1
        assert (await get("/nope"))[0] == "HTTP/1.1 404 Not Found"
        assert (await get("/metrics", "POST"))[0] == "HTTP/1.1 405 Method Not Allowed"
        with pytest.raises(MetricsError, match="choose another --metrics-port"):
            await serve(m, "127.0.0.1", port)
    finally:
        server.close()
        await server.wait_closed()


def test_metrics_port_option():
    base = ["--etcd", "127.0.0.1:1", "--store", "/tmp/s", "--plaintext"]
    assert load_config(base, environ={}).metrics_port == 0
    assert load_config(base, environ={"VARUNAD_METRICS_PORT": "9464"}).metrics_port == 9464
    assert load_config(base + ["--metrics-port", "9100"], environ={"VARUNAD_METRICS_PORT": "9464"}).metrics_port == 9100
    for bad in ("-1", "70000"):
        with pytest.raises(DaemonConfigError, match="metrics-port"):
            load_config(base + ["--metrics-port", bad], environ={})
