"""comfy/multinpu_shard.py on its own (torch and comfy-kitchen, no ComfyUI): every rank's slices of a tiny DiT's
blocks, gathered, give back the weights a replicated load holds (float, INT8 with its scales, a patched weight),
whatever the world size; a slice built on use; the resident bytes. The same with upstream's ModelPatcher and a
real sampling run is test_multinpu_shard.py. Written for the survivors of tools/mutate.py --module shard."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest

from tests.support import requires

torch = requires.module("torch", requires.NO_TORCH_REASON, allow_module_level=True)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "patches" / "src"))
import comfy.multinpu_shard as shard  # noqa: E402  (namespace package: patches/src/comfy)

PATCHED = "diffusion_model.blocks.0.1.weight"  # the LayerNorm of block 0 carries a weight patch (+1)


def tiny_dm():
    from comfy_kitchen.tensor import QuantizedTensor
    g = torch.Generator().manual_seed(0)
    blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.LayerNorm(7)) for _ in range(2))
    for p in blocks.parameters():
        p.requires_grad_(False).copy_(torch.randn(p.shape, generator=g))
    # block 0's bias 4 bytes past an alignment, as a weight in a mapped file can be: a replicated load on the cpu
    # uses it where it is, so its slot keeps that offset
    bias = blocks[0][0].bias
    buf = torch.zeros(bias.numel() + 1)
    buf[1:] = bias
    blocks[0][0]._parameters["bias"] = torch.nn.Parameter(buf[1:], requires_grad=False)
    lin = blocks[1][0]  # block 1's linear weight as INT8: its data and its per-channel scales are sharded
    lin._parameters["weight"] = torch.nn.Parameter(
        QuantizedTensor.from_float(lin.weight.detach(), "TensorWiseINT8Layout", per_channel=True), requires_grad=False)
    dm = torch.nn.Module()
    dm.blocks = blocks
    return dm


class Patcher:
    """What ShardedBlocks asks of ComfyUI's ModelPatcher: its patches, their uuid, and a patched weight."""

    def __init__(self, dm, key=PATCHED):
        self.dm, self.patches, self.patches_uuid = dm, {key: ["+1"]}, "uuid-1"
        self.asked = []

    def patch_weight_to_device(self, key, device_to, return_weight):
        assert return_weight and key in self.patches
        self.asked.append(key)
        return self.dm.get_parameter(key.removeprefix("diffusion_model.")) + 1


def weights(dm) -> dict:
    out = {}
    for name, p in dm.blocks.named_parameters():
        out[name] = p.dequantize() if hasattr(p, "dequantize") and hasattr(p, "_qdata") else p.clone()
    return out


@pytest.mark.parametrize("world", [1, 2, 3])
def test_the_slices_of_every_rank_gathered_are_the_weights_a_replicated_load_holds(world):
    dm = tiny_dm()
    expected = weights(dm)
    expected["0.1.weight"] = expected["0.1.weight"] + 1
    # each rank shards its own structural copy of the DiT, sharing the host weights (as comfy.multinpu_weights does)
    ranks = []
    for r in range(world):
        mine = copy.deepcopy(dm, memo={id(p): p for p in dm.parameters()})
        ranks.append((mine, shard.shard_module(mine, r, world, "cpu")))
    for mine, sb in ranks:
        # before the load: each slice a placeholder of its size (what ComfyUI's loader sizes), nothing resident
        assert [(sb.shard(i).device.type, sb.shard(i).numel()) for i in range(2)] == [
            ("meta", lay.shard) for lay in sb.layouts]
        assert not sb.built and shard.resident_bytes(sb) == 0
        sb.build(Patcher(mine))
        assert sb.built and all(s.dtype == torch.uint8 and s.numel() == lay.shard for s, lay in
                                zip((sb.shard(i) for i in range(2)), sb.layouts))
        assert sb.layouts[0].padded % (world * shard.ALIGN) == 0
    mine, sb = ranks[0]
    assert all(p is None for _, p in mine.blocks.named_parameters()) or not list(mine.blocks.parameters())
    assert sb.layouts[0].shifts[1] == [4]  # the unaligned bias
    flats = [torch.cat([other.shard(i) for _, other in ranks]) for i in range(2)]
    for i in range(2):
        sb.install(i, flats[i])
    # every installed weight (an INT8 weight's data) is a view of its block's gathered bytes, not a copy
    for i, block in enumerate(mine.blocks):
        for p in block.parameters():
            t = p._qdata if hasattr(p, "_qdata") else p
            assert t.untyped_storage().data_ptr() == flats[i].untyped_storage().data_ptr()
    got = weights(mine)
    assert got.keys() == expected.keys()
    for name in expected:
        assert torch.equal(got[name], expected[name]), name
    for i in range(2):
        sb.uninstall(i)
    assert list(mine.blocks.parameters()) == []


def test_a_slice_comfyui_did_not_load_is_built_on_use():
    dm = tiny_dm()
    sb = shard.shard_module(dm, 0, 2, "cpu")
    patcher = Patcher(dm)  # held, as ComfyUI holds the model's patcher (ShardedBlocks keeps a weak reference)
    sb.build(patcher)
    built = sb.shard(1).clone()
    sb.slices()[1].free()  # what ComfyUI's offload of the slice's module does (BlockSlice._apply)
    assert sb.shard(1).device.type == "meta" and not sb.built and sb.slices()[0].built_for == "uuid-1"
    sb.slices()[0]._apply(lambda t: t.float())  # a dtype change keeps the slice
    assert sb.shard(0).device.type == "cpu"
    assert torch.equal(sb.resident(1), built) and sb.rebuilt == 1 and sb.shard(1).device.type == "meta"
    assert sb.resident(0) is sb.shard(0) and sb.rebuilt == 1


def test_resident_bytes_count_each_weight_once_and_no_placeholder():
    dm = tiny_dm()
    lin, norm = dm.blocks[1][0], dm.blocks[0][1]
    q = lin.weight
    want = sum(p.numel() * p.element_size() for p in dm.parameters() if p is not q) + \
        q._qdata.numel() + q._params.scale.numel() * q._params.scale.element_size()
    assert shard.resident_bytes(dm) == want
    dm.blocks[1][1].weight = norm.weight  # the same tensor twice: counted once
    dm.extra = torch.nn.Linear(3, 3, device="meta")
    assert shard.resident_bytes(dm) == want - 7 * 4


def test_a_slice_moved_off_its_device_is_freed_a_dtype_change_or_its_own_device_keeps_it(monkeypatch):
    assert shard._target_device(lambda t: t.float()) is None
    assert shard._target_device(lambda t: t.to("cpu")) == torch.device("cpu")
    dm = tiny_dm()
    sb = shard.shard_module(dm, 0, 2, "cpu")
    sb.build(Patcher(dm))
    b = sb.slices()[0]
    b._apply(lambda t: t.to("cpu"))  # its own device
    b._apply(lambda t: t.float())    # a dtype change
    assert b.built_for == "uuid-1" and b.s.device.type == "cpu"
    # ComfyUI offloading the module to another device (an NPU's host, say): freed, never copied
    monkeypatch.setattr(shard, "_target_device", lambda fn: torch.device("cuda", 0))
    b._apply(lambda t: t)
    assert b.built_for is None and b.s.device.type == "meta" and b.s.numel() == sb.layouts[0].shard


def test_a_patched_weight_is_patched_only_by_the_ranks_whose_slice_holds_its_bytes():
    # two 512-byte weights, each in a 1024-byte slot: with 2 ranks, rank 0's slice is exactly the first slot
    blocks = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(16, 8, bias=False),
                                                      torch.nn.Linear(16, 8, bias=False))])
    dm = torch.nn.Module()
    dm.blocks = blocks.requires_grad_(False)
    first = blocks[0][0].weight.clone()
    ranks = [copy.deepcopy(dm, memo={id(p): p for p in dm.parameters()}) for _ in range(2)]
    sbs = [shard.shard_module(mine, r, 2, "cpu") for r, mine in enumerate(ranks)]
    assert [lay.shard for lay in sbs[0].layouts] == [1024]
    patchers = [Patcher(mine, key="diffusion_model.blocks.0.0.weight") for mine in ranks]
    for sb, patcher in zip(sbs, patchers):
        sb.build(patcher)
    assert [p.asked for p in patchers] == [["diffusion_model.blocks.0.0.weight"], []]
    assert sbs[0].h2d_bytes == 512 and sbs[1].h2d_bytes == 512  # rank 0: the patched weight whole; 1: its own
    sbs[0].install(0, torch.cat([sb.shard(0) for sb in sbs]))
    assert torch.equal(ranks[0].blocks[0][0].weight, first + 1)
