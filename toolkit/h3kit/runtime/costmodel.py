"""Cost model of the sequence-parallel MiniMax H3 DiT: tokens, FLOPs, bytes exchanged and memory per device.

Pure arithmetic (no torch), read from the pinned upstream:
- DiT (comfy/ldm/minimax/model.py MiniMaxH3Model defaults): 50 blocks, hidden 5376, 56 heads x 128,
  SwiGLU ffn 14336, text_dim 5120, 2 token-refiner blocks, time embedding 256 -> 5376 -> 2688, adaLN
  projections of 6 x 3 rows per block; the patch projections, time embedder and output heads are fp32.
- Video latent (comfy/ldm/minimax/vae.py): spatial stride prod(space_down) = 16, temporal chunks of 17
  frames -> 5 latents (nodes_minimax_h3.video_latent_t); frames snap up to 17k + 5; patch 1x2x2.
- Audio latent (audio_vae.py, nodes_minimax_h3.temporal_shape): 40 per second, stereo packed as two rows.
- Text: Qwen3-VL hidden states of the prompt (no chat template); the length is an assumption
  (DEFAULT_TEXT_TOKENS, --text-tokens), it moves S by that much.

The exchange model matches comfy/multinpu_dit.py exactly (the parity test checks it byte for byte):
Ulysses moves q, k, v (one packed all-to-all) and the output back, S (P-1)/P x 4 x H D elements per
block in total; the K/V fallback all-gathers K and V padded to the largest shard; after the last block
the other ranks' shards of the hidden states are gathered onto rank 0 (unpadded), which alone runs the
final layer.

A sampling step is one forward with BasicGuider (every upstream H3 template and h3kit's workflows: the
model is CFG-distilled) and two with a CFG guider (cond and uncond run as separate forwards).

Weights (additions for issue 14): replicated (every device holds the whole DiT) or sharded
(comfy/multinpu_shard.py: every device keeps one slice of each block's bytes in the layout that module
uses, and each block's whole weights are all-gathered once per forward), in bf16 or with INT8 linears
(the four linears of every block and of the token refiner at one byte a weight plus an fp32 scale per
output channel, docs/int8.md; everything else stays at the model dtype). The sharded figures (slice,
gathered bytes, resident bytes) are checked against what a real run measures (tests/test_parity_dit.py).
"""

from __future__ import annotations

import math

H3 = {
    "blocks": 50, "hidden": 5376, "heads": 56, "head_dim": 128, "ffn": 14336, "text_dim": 5120,
    "refiner_blocks": 2, "t_in": 256, "t_hidden": 5376, "t_dim": 2688, "rope_inv_freq": 16,
    "latent_channels": 24, "audio_channels": 32, "patch": (1, 2, 2),
}
VAE_STRIDE = 16            # comfy/ldm/minimax/vae.py: prod(space_down=(2, 2, 2, 2, 1, 1))
CLIP_FRAMES, CLIP_LATENTS = 17, 5   # 17-frame clips -> ceil(17 / prod(time_down=(1, 2, 2, 1, 1, 1))) latents
FPS = 24
AUDIO_LATENTS_PER_S = 40
DEFAULT_TEXT_TOKENS = 300
FORWARDS_PER_STEP = {"basic": 1, "cfg": 2}   # BasicGuider (CFG-distilled H3); CFG: cond and uncond apart
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
WEIGHTS = ("bf16", "fp16", "fp32", "int8")
SHARDINGS = ("replicated", "sharded")
# Each HCCL communicator takes 2 x HCCL_BUFFSIZE MB of device memory (CANN's default 200); the process transport
# forms two per generation when it has more than one rank: the group and its side group for the sharded weights'
# gathers (comfy.multinpu.ProcessComm.side, formed at join). Unmeasured on hardware.
HCCL_BUFFSIZE_MB = 200
COMMUNICATORS = 2
# Since torch_npu 7.1.0 each send/recv pair gets a communicator of its own with P2P_HCCL_BUFFSIZE (20 MB) each way; the
# programs' pairs (comfy.multinpu_links.program_pairs: every rank to rank 0, each rank to the next) form at join
P2P_BUFFSIZE_MB = 20
# The server's own work on device 0, beside worker rank 0 (docs/multinpu.md, "What the server keeps on device 0"): the
# text encoder's token embeddings (151936 x 5120 bf16) and vision tower, 2.8 GB together at bf16; the video VAE's
# encoder, 0.43 GB at bf16 (counted from the pin's EncoderFCN3D: ch 128, ch_mult 1 2 2 4 4 8, 2 res blocks, 3x3x3
# convolutions; an estimate from the configuration, the downsampling convolutions taken as 3x3x3), and its encode of
# one reference image at the canvas: about 4 live tensors of 128 channels at full resolution (an estimate).
# Unmeasured on hardware.
SERVER_TE_BYTES = 2_800_000_000
SERVER_VAE_ENCODER_BYTES = 431_000_000
VAE_ENCODE_LIVE_TENSORS, VAE_ENCODE_CHANNELS = 4, 128
SHARD_ALIGN = 512          # comfy.multinpu_shard.ALIGN: each tensor of a block's flat layout gets aligned(n) + 512


def align_frame_count(frames: int) -> int:
    """Frames snapped up to the 17k + 5 grid, as MiniMax H3's latent nodes do (at least 5)."""
    n = max(5, frames)
    while n % 17 != 5:
        n += 1
    return n


def video_latent_t(frames: int) -> int:
    return 2 if frames <= 5 else ((frames - 5) // CLIP_FRAMES) * CLIP_LATENTS + 2


def guide_latent_t(frames: int) -> int:
    """Latent frames of one MiniMaxH3AddGuide image or clip: an image (fewer than 5 frames: the node keeps the
    first) is one; a clip is cropped down to 17k+5 frames and encoded like a video of that length."""
    if frames < 5:
        return 1
    while frames % CLIP_FRAMES != 5:
        frames -= 1
    return video_latent_t(frames)


def packed_sequence(width: int, height: int, frames: int, text_tokens: int = DEFAULT_TEXT_TOKENS,
                    keyframes: int = 0, guides: tuple = ()) -> dict:
    """The packed token counts [text | cond | cond_audio | audio | video] for one generation: t2va, fl2va with
    keyframes (first and/or last frame), and MiniMaxH3AddGuide anchors, `guides` as (frames, audio_seconds) pairs
    (frames 0: audio only; 1: an image; 17k+5: a clip; audio cropped to the video's length, as the node does)."""
    if width % 32 or height % 32:
        raise ValueError(f"width and height must be multiples of 32 (got {width}x{height})")
    if keyframes not in (0, 1, 2):
        raise ValueError("keyframes must be 0, 1 or 2 (first and/or last frame)")
    frames = align_frame_count(frames)
    lt, lh, lw = video_latent_t(frames), height // VAE_STRIDE, width // VAE_STRIDE
    pt, ph, pw = H3["patch"]
    per_frame = (lh // ph) * (lw // pw)
    audio_t = round(frames / FPS * AUDIO_LATENTS_PER_S)
    guide_frames = sum(guide_latent_t(f) for f, _ in guides if f)
    guide_audio = sum(min(audio_t, math.ceil(a * AUDIO_LATENTS_PER_S)) for _, a in guides if a)
    seg = {"text": text_tokens, "cond": (keyframes + guide_frames) * per_frame, "cond_audio": 2 * guide_audio,
           "audio": 2 * audio_t, "video": (lt // pt) * per_frame}
    return {"frames": frames, "latent": [lt, lh, lw], "audio_latents": audio_t, "segments": seg,
            "seq_len": sum(seg.values())}


def shard_sizes(total: int, world: int) -> list:
    """Rows per device: contiguous shards, the first total % P one longer (comfy.multinpu.shard_sizes)."""
    base, extra = divmod(total, world)
    return [base + (1 if r < extra else 0) for r in range(world)]


def attention_mode(heads: int, world: int) -> str:
    if world == 1:
        return "none"
    return "ulysses" if heads % world == 0 else "kv_gather"


def exchange_elements(seq_len: int, world: int, *, hidden: int, heads: int, head_dim: int, blocks: int,
                      attention: str = None) -> dict:
    """Elements moved between devices in one DiT forward: in all (a device's own data excluded), and received by
    each device (per_device, in rank order)."""
    attention = attention or attention_mode(heads, world)
    if world == 1:
        return {"attention": attention, "per_block": 0, "final_gather": 0, "total": 0, "per_device": [0],
                "per_device_max": 0}
    p = world
    sizes = shard_sizes(seq_len, p)
    s_max = max(sizes)
    inner = heads * head_dim
    if attention == "ulysses":
        if heads % p:
            raise ValueError(f"Ulysses needs heads ({heads}) divisible by the device count ({p})")
        per_block = 4 * seq_len * (p - 1) * (inner // p)
        received = [3 * (seq_len - s) * (inner // p) + (p - 1) * s * (inner // p) for s in sizes]
    elif attention == "kv_gather":
        per_block = p * (p - 1) * s_max * 2 * inner
        received = [(p - 1) * s_max * 2 * inner] * p
    else:
        raise ValueError(f"unknown attention mode {attention!r}")
    final = (seq_len - sizes[0]) * hidden  # onto rank 0 only
    per_device = [blocks * n + (final if r == 0 else 0) for r, n in enumerate(received)]
    return {"attention": attention, "per_block": per_block, "final_gather": final,
            "total": blocks * per_block + final, "per_device": per_device, "per_device_max": max(per_device)}


def parameter_counts(cfg: dict = H3) -> dict:
    """Parameters of the DiT, split into those stored at the model dtype and the fp32 island."""
    h, inner, ffn, d = cfg["hidden"], cfg["heads"] * cfg["head_dim"], cfg["ffn"], cfg["head_dim"]
    video_dim = cfg["latent_channels"] * math.prod(cfg["patch"])
    attn = h * 3 * inner + 2 * d + inner * h
    mlp = h * 2 * ffn + ffn * h
    block = 2 * h + attn + mlp + cfg["t_dim"] * 18 * h + 18 * h
    refiner = cfg["refiner_blocks"] * (2 * h + attn + mlp) + h
    final = h + cfg["t_dim"] * 2 * h + 2 * h
    model_dtype = cfg["blocks"] * block + refiner + final + cfg["text_dim"] * h + h
    fp32 = (video_dim * h + h + cfg["audio_channels"] * h + h
            + cfg["t_in"] * cfg["t_hidden"] + cfg["t_hidden"] + cfg["t_hidden"] * cfg["t_dim"] + cfg["t_dim"]
            + h * video_dim + video_dim + h * cfg["audio_channels"] + cfg["audio_channels"] + cfg["rope_inv_freq"])
    return {"model_dtype": model_dtype, "fp32": fp32, "total": model_dtype + fp32}


def flops_per_device(seq_len: int, world: int, cfg: dict = H3) -> dict:
    """FLOPs of one forward on the busiest device (2 per multiply-add), blocks and final layer."""
    s = max(shard_sizes(seq_len, world))
    h, inner, ffn = cfg["hidden"], cfg["heads"] * cfg["head_dim"], cfg["ffn"]
    # each device computes attention for all S queries of H/P heads (Ulysses) or its s queries over all
    # S keys of H heads (K/V gather): the same S * S * H * D / P up to the shard rounding
    attention = cfg["blocks"] * 4 * s * seq_len * inner
    projections = cfg["blocks"] * 2 * s * h * 4 * inner
    mlp = cfg["blocks"] * 2 * s * h * 3 * ffn
    final = 2 * seq_len * h * cfg["latent_channels"] * math.prod(cfg["patch"])
    return {"attention": attention, "projections": projections, "mlp": mlp, "final_layer": final,
            "total": attention + projections + mlp + final}


def communicator_bytes(world: int, buffsize_mb: int = HCCL_BUFFSIZE_MB) -> int:
    """Device memory of the HCCL communicators on each device: COMMUNICATORS x 2 x HCCL_BUFFSIZE (none on one)."""
    return 0 if world <= 1 else COMMUNICATORS * 2 * buffsize_mb * 2**20


def pair_communicators(world: int) -> list:
    """The send/recv pair communicators each rank holds (unordered pairs of comfy.multinpu_links.program_pairs: every
    rank to rank 0, each rank to the next): rank 0 P - 1, the last rank 2, the others 3 (P = 2: one each)."""
    pairs = {tuple(sorted(p)) for p in [(r, 0) for r in range(1, world)] + [(r, r + 1) for r in range(world - 1)]}
    return [sum(r in p for p in pairs) for r in range(world)]


def server_share(width: int, height: int, world: int) -> dict:
    """What the server's own work holds on device 0 beside worker rank 0 (with several devices): the text encoder's
    embeddings and vision tower, the VAE encoder and its encode of one reference at the canvas. Estimates
    (SERVER_* above), unmeasured on hardware."""
    if world <= 1:
        return {"text_encoder": 0, "vae_encoder": 0, "vae_encode": 0, "total": 0}
    encode = VAE_ENCODE_LIVE_TENSORS * VAE_ENCODE_CHANNELS * width * height * 2
    out = {"text_encoder": SERVER_TE_BYTES, "vae_encoder": SERVER_VAE_ENCODER_BYTES, "vae_encode": encode}
    out["total"] = sum(out.values())
    return out


def largest_messages(seq_len: int, world: int, dtype: str = "bf16", weights: str = None,
                     sharding: str = "replicated", cfg: dict = H3) -> dict:
    """Bytes of the largest single message on each group of one rank: the group's (the Ulysses q/k/v all-to-all's
    send buffer, 3 x s x H D; the K/V gather's output in that mode) and the side group's (a sharded block's gather)."""
    if world <= 1:
        return {"group": 0, "side": 0}
    e, s, inner = DTYPE_BYTES[dtype], max(shard_sizes(seq_len, world)), cfg["heads"] * cfg["head_dim"]
    group = 3 * s * inner * e if attention_mode(cfg["heads"], world) == "ulysses" else 2 * world * s * inner * e
    side = weights_per_device(world, weights or dtype, sharding, cfg, other=dtype)["block_padded"]
    return {"group": group, "side": side}


def hccl_buffers_mb(messages: dict) -> dict:
    """Each group's HCCL buffer (MB) to hold its largest message whole, never below HCCL's 200 MB default."""
    return {k: max(HCCL_BUFFSIZE_MB, math.ceil(v / 2**20)) for k, v in messages.items()}


def memory_per_device(seq_len: int, world: int, dtype: str = "bf16", cfg: dict = H3, weights: str = None,
                      sharding: str = "replicated", hccl_buffsize_mb: int = HCCL_BUFFSIZE_MB, server: int = 0) -> dict:
    """Bytes on each device: the DiT weights (the whole DiT, or with sharding the resident slices plus two
    gathered blocks), the HCCL communicators' buffers (communicator_bytes) and an estimate of the peak
    activations of one forward. weights: the weights' storage (default: dtype; "int8" for INT8 linears, the rest
    at dtype).

    Activation phases (the largest one counts): the full sequence every device embeds before block 0;
    attention on the shard with the Ulysses buffers (or the gathered K/V); the SwiGLU MLP on the shard;
    the final all-gather (padded parts plus the result). Backend workspaces are not included. `server` (device 0
    only: the server's own encodes beside worker rank 0) is held before sampling and freed when it starts
    (comfy.multinpu_dit.free_server_share), so device 0's peak is the larger of it and the forward's activations.
    """
    e = DTYPE_BYTES[dtype]
    w = weights_per_device(world, weights or dtype, sharding, cfg, other=dtype)
    sizes = shard_sizes(seq_len, world)
    s, p = max(sizes), world
    h, inner, ffn = cfg["hidden"], cfg["heads"] * cfg["head_dim"], cfg["ffn"]
    embed = 2 * seq_len * h
    mode = attention_mode(cfg["heads"], world)
    if mode == "kv_gather":
        exchange = 2 * 2 * seq_len * inner                   # gathered K/V parts and their concatenation
    elif mode == "ulysses":                                  # send chunks, received parts + their permute, output
        exchange = 3 * s * inner + 2 * 3 * seq_len * inner // p + seq_len * inner // p
    else:
        exchange = 0
    attention = s * (2 * h + 3 * inner + inner) + exchange + s * inner
    mlp = s * (2 * h + 3 * ffn)
    gather = (p * s + seq_len) * h if world > 1 else 0
    activations = (max(embed, attention, mlp, gather) + s * h) * e
    held = w["resident"] + w["gathered"]
    # on device 0 (the busiest: rank 0 holds P - 1 pair communicators and the server's share beside its own work)
    pairs = pair_communicators(world)[0] * 2 * P2P_BUFFSIZE_MB * 2**20 if world > 1 else 0
    comms = communicator_bytes(world, hccl_buffsize_mb) + pairs
    return {"weights": held, "weights_resident": w["resident"], "weights_gathered": w["gathered"],
            "communicators": comms, "pair_communicators": pairs, "server_share": server, "activations": activations,
            "total": held + comms + max(activations, server)}


def plan(width: int, height: int, frames: int, world: int, *, text_tokens: int = DEFAULT_TEXT_TOKENS,
         keyframes: int = 0, dtype: str = "bf16", tflops: float = None, link_gbs: float = None,
         guider: str = "basic", weights: str = None, sharding: str = "replicated",
         device_memory_gb: float = None, guides: tuple = ()) -> dict:
    """The whole model for one configuration. guider "basic" (one forward per step) or "cfg" (two). tflops
    (effective per device) and link_gbs (exchange GB/s per device) are optional calibrations; with them the
    plan predicts seconds per step. weights (default dtype; "int8") and sharding ("replicated", "sharded")
    size the weights on each device and the extra bytes the sharded weights' gathers move per step;
    device_memory_gb (a card's memory) adds whether the tier fits and its headroom ("fit")."""
    forwards = FORWARDS_PER_STEP[guider]
    seq = packed_sequence(width, height, frames, text_tokens, keyframes, guides)
    s_len = seq["seq_len"]
    e = DTYPE_BYTES[dtype]
    ex = exchange_elements(s_len, world, hidden=H3["hidden"], heads=H3["heads"], head_dim=H3["head_dim"],
                           blocks=H3["blocks"])
    flops = flops_per_device(s_len, world)
    out = {
        "width": width, "height": height, "frames": seq["frames"], "npu_count": world, "dtype": dtype,
        "text_tokens": text_tokens, "keyframes": keyframes, "guides": [list(g) for g in guides],
        "latent": seq["latent"],
        "audio_latents": seq["audio_latents"], "segments": seq["segments"], "seq_len": s_len,
        "tokens_per_device": shard_sizes(s_len, world), "attention": ex["attention"],
        "guider": guider, "forwards_per_step": forwards,
        "flops_per_device_forward": flops, "flops_per_device_step": flops["total"] * forwards,
        "bytes_per_block": ex["per_block"] * e, "bytes_final_gather": ex["final_gather"] * e,
        "bytes_per_forward": ex["total"] * e, "bytes_per_step": ex["total"] * e * forwards,
        "bytes_per_device_step": ex["per_device_max"] * e * forwards,
        "memory_per_device": memory_per_device(s_len, world, dtype, weights=weights, sharding=sharding,
                                               server=server_share(width, height, world)["total"]),
        "server_share": server_share(width, height, world),
        "pair_communicators": pair_communicators(world),
    }
    messages = largest_messages(s_len, world, dtype, weights, sharding)
    sizes = hccl_buffers_mb(messages)
    out["hccl"] = {"largest_message": messages, "buffsize_mb": sizes,
                   "env": f"H3KIT_HCCL_BUFFSIZE={sizes['group']},{sizes['side']}" if world > 1 else None}
    w = weights_per_device(world, weights or dtype, sharding, other=dtype)
    # sharding as asked: on one device there is nothing to shard, and its figures are the replicated ones
    out.update({"weights": weights or dtype, "sharding": sharding,
                "weight_bytes_per_device_step": w["received_per_forward"] * forwards,
                "weight_bytes_per_step": w["moved_per_forward"] * forwards})
    if device_memory_gb is not None:
        out["fit"] = fit(out["memory_per_device"]["total"], device_memory_gb)
    if tflops:
        out["seconds_compute_step"] = out["flops_per_device_step"] / (tflops * 1e12)
    if link_gbs:
        out["seconds_exchange_step"] = out["bytes_per_device_step"] / (link_gbs * 1e9)
    return out


def fit(need: int, device_memory_gb: float) -> dict:
    """Whether `need` bytes fit a card of `device_memory_gb` GB (1e9 bytes), with the headroom left (negative:
    short by that much)."""
    memory = int(device_memory_gb * 1e9)
    return {"device_memory": memory, "need": need, "headroom": memory - need, "fits": need <= memory}


# ---- additions for doctor and calibrate: the tiers, INT8 weights, one rank's messages -----------------

# The settings a deployment is sized for: the official 768p canvas at about 5 s and 15 s (24 fps).
GEOMETRIES = {"768p/5s": (1344, 768, 124), "768p/15s": (1344, 768, 362)}


def _linears(cfg: dict) -> list:
    """(out, in) of the four linears of a DiT block (and of a refiner block): qkv, out, fc1 (SwiGLU), fc2."""
    h, inner, ffn = cfg["hidden"], cfg["heads"] * cfg["head_dim"], cfg["ffn"]
    return [(3 * inner, h), (h, inner), (2 * ffn, h), (h, ffn)]


def int8_parameters(cfg: dict = H3) -> dict:
    """The INT8 linears of an H3 INT8 checkpoint (docs/int8.md): the four linears of every block and of every
    token-refiner block. {"weights": int8 parameters, "scales": fp32 per-channel scales}."""
    layers = cfg["blocks"] + cfg["refiner_blocks"]
    return {"weights": layers * sum(o * i for o, i in _linears(cfg)), "scales": layers * sum(o for o, _ in _linears(cfg))}


def weight_bytes(weights: str = "bf16", cfg: dict = H3, other: str = "bf16") -> int:
    """DiT weight bytes on each device: "bf16", "fp16" or "fp32", or "int8": the INT8 linears at one byte a
    weight plus an fp32 scale per output channel, every other model-dtype parameter (the adaLN projections,
    13.0 B in the full checkpoints, norms, embeddings) at `other`; the fp32 island (patch projections, time
    embedder, output heads) stays fp32 in every case."""
    params = parameter_counts(cfg)
    if weights != "int8":
        return params["model_dtype"] * DTYPE_BYTES[weights] + params["fp32"] * 4
    q = int8_parameters(cfg)
    return (q["weights"] + q["scales"] * 4 + (params["model_dtype"] - q["weights"]) * DTYPE_BYTES[other]
            + params["fp32"] * 4)


def block_tensor_bytes(weights: str = "bf16", cfg: dict = H3, other: str = "bf16") -> list:
    """Bytes of every tensor of one DiT block as the sharded layout holds it (an INT8 linear is two tensors: its
    int8 data and its scales): two norms of hidden, q and k norms of head_dim, the four linears, the adaLN
    projection (18 x hidden rows of t_dim, and its bias)."""
    e = DTYPE_BYTES[other if weights == "int8" else weights]
    h, d, t = cfg["hidden"], cfg["head_dim"], cfg["t_dim"]
    out = [h * e, h * e, d * e, d * e, 18 * h * t * e, 18 * h * e]
    for o, i in _linears(cfg):
        out += [o * i, o * 4] if weights == "int8" else [o * i * e]
    return out


def shard_layout(tensor_bytes: list, world: int) -> dict:
    """comfy.multinpu_shard's flat layout of one block: each tensor in a slot of its bytes rounded up to
    SHARD_ALIGN plus one SHARD_ALIGN, the total padded to world x SHARD_ALIGN and cut into `world` slices."""
    slots = sum(-(-n // SHARD_ALIGN) * SHARD_ALIGN + SHARD_ALIGN for n in tensor_bytes)
    unit = world * SHARD_ALIGN
    padded = -(-slots // unit) * unit
    return {"bytes": sum(tensor_bytes), "padded": padded, "slice": padded // world}


def weights_per_device(world: int, weights: str = "bf16", sharding: str = "replicated", cfg: dict = H3,
                       other: str = "bf16") -> dict:
    """The DiT's weight bytes on each device between forwards (resident), the most a forward adds while it runs
    (gathered: two whole blocks with sharding, the one running and the next one's gather), and the bytes one
    forward's weight gathers move: received per device and moved in all (every device receives the other
    world - 1 slices of every block)."""
    full = weight_bytes(weights, cfg, other)
    if sharding == "replicated" or world == 1:
        return {"sharding": "replicated", "resident": full, "gathered": 0, "received_per_forward": 0,
                "moved_per_forward": 0, "slice": 0, "block_padded": 0}
    block = block_tensor_bytes(weights, cfg, other)
    lay = shard_layout(block, world)
    received = cfg["blocks"] * (world - 1) * lay["slice"]
    return {"sharding": "sharded", "resident": full - cfg["blocks"] * lay["bytes"] + cfg["blocks"] * lay["slice"],
            "gathered": 2 * lay["padded"], "received_per_forward": received, "moved_per_forward": world * received,
            "slice": lay["slice"], "block_padded": lay["padded"]}


def exchange_messages(seq_len: int, world: int, cfg: dict = H3) -> dict:
    """Elements one rank (the busiest: the first, longest shard) receives per collective of one forward.

    Ulysses (heads divisible by the devices, as H3's 56 over 2, 4 and 8): "scatter" is the packed q, k, v
    all-to-all before attention (3 x the other ranks' rows x H/P heads), "gather" the output all-to-all
    after it (this rank's rows of the other ranks' heads); both happen in every block. "final" is the
    hidden states' gather onto rank 0 after the last block (each shard at its own length). Also the shapes the rank
    sends, for a benchmark to reproduce them: qkv [3, H, s_r, D], out [1, S, H/P, D], h [s_r, hidden].
    """
    sizes = shard_sizes(seq_len, world)
    s, p = sizes[0], world
    heads, d, hidden = cfg["heads"], cfg["head_dim"], cfg["hidden"]
    if p > 1 and attention_mode(heads, p) != "ulysses":
        raise ValueError(f"exchange_messages models Ulysses only: {heads} heads do not split over {p} devices")
    hp = heads // p
    return {"shard": s, "sizes": sizes,
            "scatter": 3 * (seq_len - s) * hp * d, "gather": (p - 1) * s * hp * d,
            "final": (seq_len - s) * hidden if p > 1 else 0,
            "shapes": {"qkv": [3, heads, s, d], "out": [1, seq_len, hp, d], "h": [s, hidden]}}
