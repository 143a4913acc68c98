"""MiniMax H3 video VAE decode across devices: temporal chunks decoded on every rank, blended in order.

MiniMaxH3VideoVAE.decode_temporal (comfy/ldm/minimax/vae.py) cuts the latents into overlapping temporal
chunks (7 latents, 28 frames, for the real VAE), decodes each with _adaptive_decode (spatial tiles
inside), blends each chunk into the previous one's overlap and writes the frames out in order. The chunk
decodes are independent; only the blend is ordered. No upstream file is edited: apply_decode_parallel(vae,
devices) returns a VAE whose decode_temporal

1. plans the chunks as upstream does (its _decode_temporal_chunks, the same padding and slices),
2. hands them to the ranks as one command (the worker program "vae_decode"): chunk i is decoded on rank i % P
   by upstream's _adaptive_decode on the rank's own copy of the decoder, and worker rank 0 gathers them in
   order and hands them back (through shared memory with processes, a host buffer with threads),
3. runs upstream's decode_temporal unchanged, whose _adaptive_decode now hands back the decoded chunks in
   order, each copied to the server copy's device when the blend asks for it. The blend, the conversion to
   pixels and the writes into the output buffer are upstream's own code, in upstream's order, on the device
   where one-device decoding runs them.

The ranks are those of the runtime comfy.multinpu_process.runtime_for() gives, the processes of the server's group or
threads of this process on `devices`: the same programs, the same command path, the same server-side
copy. Every rank sets its decoder up with the configuration "vae_config": it loads the same file through the same
cached loader (threads take the server's loaded VAE, comfy.multinpu_models.offer) and keeps a structural copy of its
own over the one host copy (comfy.multinpu_weights), so loading rank r's onto device r moves no other rank's.
A single-frame decode goes to worker rank 0 as one chunk. The server computes no decode, so its copy holds only
what it runs, the encoder (reference images, keyframes) and the latent and pixel statistics, and the ranks hold
only the decoder (and its post-quant convolution): device 0 holds each weight once.

Each chunk is decoded by the same code on the same kind of device from the same latents, so the video is
bit-identical to the one-device decode (h3kit parity --component vae gates max_abs == 0). All the decoded chunks
are on the host at once, between the command and the blend.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from typing import TYPE_CHECKING

import torch

import comfy.ldm.minimax.vae
import comfy.model_management
import comfy.multinpu
import comfy.multinpu_group
import comfy.multinpu_models
import comfy.multinpu_process
import comfy.multinpu_runtime_base
import comfy.multinpu_weights

if TYPE_CHECKING:
    from comfy.sd import VAE


def plan_chunks(vae, z: torch.Tensor) -> list:
    """The latent chunks decode_temporal decodes, in order: [B, C, 7, h, w] slices of the padded z."""
    pad_tokens, num_chunks = vae._decode_temporal_chunks(z.shape[2])
    if pad_tokens > 0:
        z = torch.cat([z, z[:, :, -1:, :, :].repeat(1, 1, pad_tokens, 1, 1)], dim=2)
    size = vae.tokens_chunk_size
    return [z[:, :, i * size:i * size + size + vae.token_overlap, :, :] for i in range(num_chunks)]


def fetch_chunk(chunk: torch.Tensor, device: torch.device, src_rank: int) -> torch.Tensor:
    """A decoded chunk (on the host, from worker rank 0) onto the server copy's `device`; src_rank: the rank that
    decoded it (parity's injected fault zeroes the chunks of ranks other than 0 here)."""
    return chunk.to(device)


class _ChunkStream:
    """One decode_temporal call's decoded chunks, handed back to upstream's blend in order."""

    def __init__(self, runner: VideoDecodeParallel, chunks: list, decoded: list):
        self.runner = runner
        self.chunks = chunks
        self.decoded = decoded
        self.next = 0

    def take(self, z: torch.Tensor) -> torch.Tensor:
        i = self.next
        if i >= len(self.chunks) or z.shape != self.chunks[i].shape or not torch.equal(z, self.chunks[i]):
            # upstream's chunk plan changed under us: refuse rather than blend the wrong chunks
            raise RuntimeError(f"MultiNPU: the VAE asked for a chunk (#{i}, {tuple(z.shape)}) that the parallel "
                               f"plan of {len(self.chunks)} chunks does not have at that place")
        self.next += 1
        rank = i % self.runner.world_size
        chunk, self.decoded[i] = self.decoded[i], None
        self.runner.bytes_moved += 0 if rank == 0 else chunk.numel() * chunk.element_size()
        return fetch_chunk(chunk, z.device, rank)


class VideoDecodeParallel:
    """The server side of the parallel decode: every decode is a "vae_decode" command on the ranks of `runtime`
    (processes or threads), each holding `config` (its decoder) first.

    forwards counts decode_temporal calls, chunks the chunks decoded, single_frames the decodes outside
    decode_temporal (worker rank 0), bytes_moved the bytes of the chunks ranks other than 0 decoded, chunk_ranks
    the rank that decoded each chunk of the last call.
    """

    def __init__(self, runtime, config):
        self.runtime = runtime  # a comfy.multinpu_runtime_base.Runtime (comfy.multinpu_process.runtime_for)
        self.config = config
        self.world_size = runtime.world_size
        self.forwards = 0
        self.chunks = 0
        self.single_frames = 0
        self.bytes_moved = 0
        self.chunk_ranks = []
        self._lock = threading.Lock()

    def _decode(self, chunks: list) -> list:
        return self.runtime.run("vae_decode", {"config": self.config.id, "chunks": chunks}, configs=[self.config])

    def decode_in_workers(self, z: torch.Tensor) -> torch.Tensor:
        """A decode outside decode_temporal (a single frame): upstream's _adaptive_decode on worker rank 0 (the
        server's copy holds no decoder); the pixels come back onto z's device."""
        with self._lock:
            (out,) = self._decode([z])
        self.single_frames += 1
        return out.to(z.device)

    def decode_temporal(self, vae0, z, output_buffer):
        chunks = plan_chunks(vae0, z)
        t0 = time.perf_counter()
        with self._lock:
            # chunk i decoded on rank i % P, all of them handed back by worker rank 0 in order; the blend runs
            # here, upstream's code on the chunks as one-device decoding would
            decoded = self._decode(chunks)
            self.chunk_ranks = [i % self.world_size for i in range(len(chunks))]
            self.chunks += len(chunks)
            stream = _ChunkStream(self, chunks, list(decoded))
            vae0.__dict__["_multinpu_stream"] = stream
            try:
                out = comfy.ldm.minimax.vae.MiniMaxH3VideoVAE.decode_temporal(vae0, z, output_buffer)
            finally:
                vae0.__dict__.pop("_multinpu_stream", None)
        if stream.next != len(chunks):
            raise RuntimeError(f"MultiNPU: the VAE blended {stream.next} of the {len(chunks)} chunks it planned")
        self.forwards += 1
        logging.debug(f"MultiNPU: video VAE decode of {len(chunks)} chunks on {self.world_size} devices in "
                      f"{time.perf_counter() - t0:.3f} s")
        return out


_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def _send_chunk(comm, chunk: torch.Tensor):
    header = torch.zeros(8, dtype=torch.int64, device=comm.device)
    header[0], header[1] = chunk.dim(), _DTYPES.index(chunk.dtype)
    header[2:2 + chunk.dim()] = torch.tensor(chunk.shape)
    comm.send(header, 0)
    comm.send(chunk.contiguous(), 0)


def _recv_chunk(comm, src: int) -> torch.Tensor:
    header = comm.recv(torch.empty(8, dtype=torch.int64, device=comm.device), src).tolist()
    shape = header[2:2 + header[0]]
    return comm.recv(torch.empty(shape, dtype=_DTYPES[header[1]], device=comm.device), src)


class _InWorkers(torch.nn.Module):
    """Where a copy of the VAE leaves out a part run elsewhere (the server or the ranks): no weights, the
    attributes upstream reads (the decoder's out_channels), and a forward that refuses."""

    def __init__(self, what: str, where: str, **attributes):
        super().__init__()
        self.what, self.where = what, where
        self.__dict__.update(attributes)

    def forward(self, *args, **kwargs):
        raise RuntimeError(f"MultiNPU: the video VAE's {self.what} runs in {self.where}, not here")


def server_model(source):
    """The server's video VAE: the encoder, the quant convolution and the statistics (buffers), what the server
    computes; the decoder and its post-quant convolution are left to the ranks."""
    return comfy.multinpu_weights.share_module(source, replace=[
        (source.decoder, _InWorkers("decoder", "the ranks' programs", out_channels=source.decoder.out_channels)),
        (source.post_quant_conv, _InWorkers("post-quant convolution", "the ranks' programs"))])


def worker_model(source):
    """A rank's video VAE: the decoder side only (the server encodes), its own modules over the shared host
    weights."""
    return comfy.multinpu_weights.share_module(source, replace=[
        (source.encoder, _InWorkers("encoder", "the server")),
        (source.quant_conv, _InWorkers("quant convolution", "the server"))])


class _WorkerVAE:
    """A rank's video VAE for one configuration: the decoder side of the one it loaded, and its patcher."""

    def __init__(self, model, patcher, digest):
        self.model = model
        self.patcher = patcher
        self.digest = digest


def _tick_blocks(model, comm):
    """A tick after each of the decoder's transformer blocks: a decoding rank's device advances within a chunk, where
    it completes no collective for as long as the chunk takes (comfy.multinpu_clock)."""
    for i, block in enumerate(getattr(model.decoder, "transformer_blocks", None) or []):
        block.register_forward_hook(lambda module, args, output, i=i: comfy.multinpu.tick(comm, f"vae block {i}"))


@comfy.multinpu_group.program("vae_config")
def _load_on_worker(context, comm, payload):
    src = payload["source"]
    vae = comfy.multinpu_models.load(src)
    comfy.multinpu_models.map_file_weights(vae.first_stage_model, src.paths)
    comfy.multinpu_weights.anchor_host_copy(vae.first_stage_model)
    # the rank's own modules over the shared host weights: ranks that are threads of one process get the same VAE
    # from the loader, and loading rank r's copy onto device r must not move rank q's
    model = worker_model(vae.first_stage_model)
    _tick_blocks(model, comm)
    comfy.multinpu_weights.reset_load_state(model)
    patcher = comfy.multinpu_weights.device_patcher(vae.patcher, model, context.device)
    return _WorkerVAE(model, patcher, comfy.multinpu_models.digest(src, vae.first_stage_model))


@comfy.multinpu_group.program("vae_decode")
def _decode_on_worker(context, comm, payload):
    """Chunk i on rank i % P; rank 0 returns every decoded chunk in order, each moved to the host as it
    arrives (they reach the server through shared memory or a host buffer; the device holds one wave at a time)."""
    held = context.configs[payload["config"]]
    with comfy.multinpu_runtime_base.MODEL_LOCK:  # model management is one per process, not thread-safe
        comfy.model_management.load_models_gpu([held.patcher])
    chunks = payload["chunks"]

    def decode(i):
        z = chunks[i].to(held.patcher.load_device)
        out = comfy.ldm.minimax.vae.MiniMaxH3VideoVAE._adaptive_decode(held.model, z)
        comfy.multinpu.tick(comm, f"vae chunk {i}")
        return out

    if comm.rank != 0:
        for i in range(comm.rank, len(chunks), comm.world_size):
            _send_chunk(comm, decode(i))
        return None
    return [(decode(i) if i % comm.world_size == 0 else _recv_chunk(comm, i % comm.world_size)).cpu()
            for i in range(len(chunks))]


class ParallelVideoVAE(comfy.ldm.minimax.vae.MiniMaxH3VideoVAE):
    """The server's video VAE: its decodes run on the ranks (VideoDecodeParallel), its encodes here."""

    def decode_temporal(self, z, output_buffer=None):
        return self.multinpu.decode_temporal(self, z, output_buffer)

    def _adaptive_decode(self, z):
        stream = self.__dict__.get("_multinpu_stream")
        if stream is not None:
            return stream.take(z)
        return self.multinpu.decode_in_workers(z)


def apply_decode_parallel(vae: VAE, devices=None, timeout: float = comfy.multinpu.DEFAULT_TIMEOUT) -> VAE:
    """A copy of `vae` (a MiniMax H3 video VAE loaded by VAELoader) whose decodes run on this server's runtime.

    The ranks are comfy.multinpu_process.runtime_for(devices, the VAE's device, ...): the server's process group,
    or threads of this process on `devices` (rank 0 = devices[0], the VAE's device; collectives bounded by
    `timeout`). Either way every rank loads the same file and keeps its own copy of the decoder over the host
    weights, checked before the first decode, and the copy returned, which loads onto the VAE's device, keeps the
    encoder and decodes nothing itself. Raises ValueError for any other VAE (the audio VAE stays on one device, in
    fp32), one no cached loader loaded, or devices that do not start at the VAE's device.
    """
    source = vae.first_stage_model
    if type(source) is not comfy.ldm.minimax.vae.MiniMaxH3VideoVAE:
        what = "already split across devices" if isinstance(source, ParallelVideoVAE) else f"a {type(source).__name__}"
        raise ValueError(f"MultiNPU: parallel decode is for the MiniMax H3 video VAE; this VAE is {what}")
    src = comfy.multinpu_models.source(source, "VAE")
    runtime = comfy.multinpu_process.runtime_for(devices, vae.device, "VAE", timeout)
    # ranks that are threads of this process load nothing: they take this VAE
    comfy.multinpu_models.offer(src, vae)
    # the loaded weights, back on the host, are the one host copy every rank's copy shares
    comfy.model_management.unload_model_and_clones(vae.patcher, all_devices=True)
    comfy.multinpu_models.map_file_weights(source, src.paths)
    comfy.multinpu_weights.anchor_host_copy(source)
    # the server's one copy keeps the encoder side, the ranks decode
    server = server_model(source)
    comfy.multinpu_weights.reset_load_state(server)
    config = comfy.multinpu_process.RemoteConfig("vae_config", {"source": src},
                                                 comfy.multinpu_models.digest(src, source), f"VAE {src.paths[0]}")
    server.__class__ = ParallelVideoVAE
    server.multinpu = VideoDecodeParallel(runtime, config)

    n = copy.copy(vae)  # the VAE's settings (dtypes, memory estimates, strides) are shared, read-only
    n.first_stage_model = server
    n.patcher = comfy.multinpu_weights.device_patcher(vae.patcher, server, vae.device)
    logging.info(f"MultiNPU: video VAE decodes temporal chunks on {runtime.describe()} (every rank holds the decoder, the server "
                 f"the encoder, {n.patcher.model_size() / 2**30:.2f} of {vae.patcher.model_size() / 2**30:.2f} GiB)")
    return n


def get_runner(vae: VAE):
    """The VideoDecodeParallel of a VAE set up by apply_decode_parallel, or None."""
    model = getattr(vae, "first_stage_model", None)
    return model.multinpu if isinstance(model, ParallelVideoVAE) else None
