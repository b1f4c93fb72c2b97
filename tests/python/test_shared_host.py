"""One host copy of the frozen weights for the ranks of a host (LAYERSTREAM_SHARE_HOST): two real
processes in a gloo process group, each with LOCAL_RANK / LOCAL_WORLD_SIZE as torchrun sets them, attach
the same model and train its LoRA under DistributedDataParallel. Local rank 0 packs the weights into shared
segments; rank 1 maps them (no arena bytes of its own) after checking they hold what it would have packed.
Training equals a single process on the whole batch (within the reduction-order bound)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from layerstream import manager_modules as mm

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from models import TinyTransformer  # noqa: E402
from share_common import LoRANet, batch  # noqa: E402

pytestmark = pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="needs POSIX shared memory (/dev/shm)")


def _ls_segments() -> set[str]:
    return {p.name for p in Path("/dev/shm").iterdir() if p.name.startswith("ls-")}


def _run_ranks(tmp_path, backend, *extra, env=None, world=2):
    init = tmp_path / "init"
    outs = [tmp_path / f"rank{r}.json" for r in range(world)]
    procs = []
    for r in range(world):
        e = dict(os.environ, **(env or {}))
        e.pop("LOCAL_RANK", None)
        procs.append(subprocess.Popen([sys.executable, str(HERE / "share_worker.py"), str(r), str(world), str(init),
                                       str(outs[r]), backend, *extra], env=e, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    logs = [p.communicate(timeout=300)[0] for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log
    return [json.loads(o.read_text()) for o in outs]


def _single_process_reference(steps: int):
    """The same training in one process, on the whole batch, every weight its own (no manager needed:
    the managed layers are bitwise the all-resident ones)."""
    torch.manual_seed(0)
    model = TinyTransformer(checkpointing="non_reentrant").requires_grad_(False)
    net = LoRANet(model)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    for step in range(steps):
        x, target = batch(step)
        opt.zero_grad(set_to_none=True)
        (net(x) - target).pow(2).mean().backward()
        opt.step()
    return [p.detach() for p in net.parameters()]


@pytest.mark.parametrize("backend", ["cpu", "sim", "cuda"])
def test_two_ranks_share_one_host_copy_and_train_like_one_process(tmp_path, backend):
    if backend == "cuda" and torch.cuda.device_count() < 2:
        pytest.skip(f"needs two GPUs (this machine has {torch.cuda.device_count()})")
    before = _ls_segments()
    leader, follower = _run_ranks(tmp_path, backend)
    # Every frozen block is one shared segment: the leader made them, the follower mapped the same ones
    # and holds no arena bytes of its own.
    assert leader["host_shared_blocks"] == follower["host_shared_blocks"] == 18  # 3 blocks x 6 linears
    assert leader["host_shared_bytes"] == follower["host_shared_bytes"] == leader["packed"] == follower["packed"]
    assert leader["arena_bytes"] == follower["arena_bytes"] == 0
    assert leader["mappings"] == follower["mappings"] == 18
    # Nothing is left in /dev/shm: the names went once both ranks had them mapped.
    assert _ls_segments() == before
    # DDP over the LoRA: both ranks end with the same LoRA, equal to one process on the whole batch.
    assert leader["lora"] == follower["lora"]
    reference = _single_process_reference(steps=len(leader["losses"]))
    for got, want in zip(leader["lora"], reference):  # GPU GEMMs differ from the CPU reference's a little more
        tol = dict(rtol=1e-4, atol=1e-5) if backend == "cuda" else dict(rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(torch.tensor(got), want, **tol)


def test_quantized_weights_are_shared_as_stored(tmp_path):
    pytest.importorskip("optimum.quanto", reason="optimum-quanto is not installed")
    before = _ls_segments()
    leader, follower = _run_ranks(tmp_path, "sim", "--quantized")
    assert leader["host_shared_blocks"] == follower["host_shared_blocks"] == 18
    # what is shared is what was packed: the codes at one byte a weight, the scales and the biases
    assert leader["host_shared_bytes"] == follower["host_shared_bytes"] == leader["packed"]
    assert follower["arena_bytes"] == 0
    assert leader["lora"] == follower["lora"]
    assert _ls_segments() == before


def test_losslessly_packed_weights_are_shared_and_no_rank_keeps_a_plain_copy(tmp_path):
    before = _ls_segments()
    leader, follower = _run_ranks(tmp_path, "sim", "--lossless", env={"LAYERSTREAM_HOST_DTYPE": "lossless"})
    assert leader["host_shared_blocks"] == follower["host_shared_blocks"] == 18
    assert leader["host_shared_bytes"] == follower["host_shared_bytes"] == leader["packed"] == follower["packed"]
    assert follower["arena_bytes"] == 0
    # Every rank's weight Parameters hold the shared packed bytes only (PackedWeight), no plain copy.
    assert leader["packed_weights"] == follower["packed_weights"] == 18
    assert leader["host_pageable_bytes"] == follower["host_pageable_bytes"] == 0
    assert leader["lora"] == follower["lora"]  # DDP: the same LoRA on both ranks
    assert _ls_segments() == before


def test_a_rank_with_other_weights_is_refused_with_the_remedy(tmp_path):
    before = _ls_segments()
    leader, follower = _run_ranks(tmp_path, "sim", "--other-weights")
    assert "attach_error" not in leader
    assert "differ from the host copy that local rank 0 packed" in follower["attach_error"]
    assert "LAYERSTREAM_SHARE_HOST=0" in follower["attach_error"]
    assert _ls_segments() == before


def test_torchrun_ranks_agree_on_the_name_without_a_collective_call(tmp_path):
    """Under torchrun (TORCHELASTIC_RUN_ID, MASTER_PORT, one parent) the name comes from the environment."""
    before = _ls_segments()
    leader, follower = _run_ranks(tmp_path, "sim", env={"TORCHELASTIC_RUN_ID": "test-run", "MASTER_PORT": "29999"})
    assert leader["host_shared_blocks"] == follower["host_shared_blocks"] == 18
    assert follower["arena_bytes"] == 0 and leader["lora"] == follower["lora"]
    assert _ls_segments() == before


def test_share_host_off_gives_each_rank_its_own_copy(tmp_path):
    leader, follower = _run_ranks(tmp_path, "sim", env={"LAYERSTREAM_SHARE_HOST": "0"}, )
    for r in (leader, follower):
        assert r["host_shared_blocks"] == 0 and r["mappings"] == 0
        assert r["arena_bytes"] == r["packed"]
    assert leader["lora"] == follower["lora"]


def test_one_process_without_ranks_shares_nothing(engine, device):
    layer = torch.nn.Linear(8, 8).requires_grad_(False)

    class Manager:
        process_device = device

    mm.LinearLayerMemoryManager.attach(layer, Manager())
    assert mm.stats()["host_shared_blocks"] == 0
