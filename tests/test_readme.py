"""The README's Python examples run as written (issue 13: the public API and the README
change together). Each ```python block is executed in order in one namespace; the test
provides only what the prose assumes: a running aggregator and its cluster.json, a
gradient ``grad``, and for the DDP block a model in a one-process group."""
from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_the_three_examples():
    blocks = python_blocks()
    assert len(blocks) == 3
    assert "THCCodec" in blocks[0] and "AggregationClient" in blocks[1] and "THCHook" in blocks[2]


def test_codec_example_estimates_the_mean():
    ns: dict = {}
    exec(python_blocks()[0], ns)
    true_mean = torch.stack(ns["xs"]).mean(0)
    nmse = float(((ns["mean"] - true_mean) ** 2).sum() / (true_mean ** 2).sum())
    assert nmse < 0.05, nmse


def test_aggregator_and_ddp_examples_run(tmp_path, monkeypatch):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from thc.net.aggregator import Aggregator
    from thc.testing.clusters import free_port_block, free_tcp_port, local_job
    from thc.wire.jobs import Cluster

    blocks = python_blocks()
    job = local_job(1, 1, free_port_block(1))
    with Aggregator([job]) as agg:
        host, port = agg.start()
        Cluster(jobs=(job,), agg_ip=host, agg_port=port).save(tmp_path / "cluster.json")
        monkeypatch.chdir(tmp_path)
        ns: dict = {}
        exec(blocks[0], ns)
        ns["grad"] = torch.randn(5000)
        exec(blocks[1], ns)
        err = float(((ns["mean_grad"] - ns["grad"]) ** 2).sum() / (ns["grad"] ** 2).sum())
        assert err < 0.05, err

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_tcp_port()}",
                                rank=0, world_size=1)
        try:
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Linear(8, 2))
            plain = copy.deepcopy(model)
            ns["model"], ns["ddp_model"] = model, DDP(model)
            exec(blocks[2], ns)
            x = torch.randn(4, 16)
            ns["ddp_model"](x).sum().backward()
            plain(x).sum().backward()
            # one worker: the biases (kept FP32, as the example asks) get their own gradient,
            # the weights its THC estimate through the aggregator
            assert ns["hook"].fp32_elements == 8 + 2 and ns["hook"].bytes_sent > 0
            for (name, p), q in zip(model.named_parameters(), plain.parameters()):
                if "bias" in name:
                    torch.testing.assert_close(p.grad, q.grad)
                else:
                    err = float(((p.grad - q.grad) ** 2).sum() / (q.grad ** 2).sum())
                    assert err < 0.1, (name, err)
        finally:
            dist.destroy_process_group()
