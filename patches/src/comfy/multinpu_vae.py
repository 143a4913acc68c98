"""MiniMax H3 video VAE decode across devices: temporal chunks decoded on every device, blended in order.

MiniMaxH3VideoVAE.decode_temporal (comfy/ldm/minimax/vae.py) cuts the latents into overlapping temporal
chunks (7 latents, 28 frames, for the real VAE), decodes each with _adaptive_decode (spatial tiles
inside), blends each chunk into the previous one's overlap and writes the frames out in order. The chunk
decodes are independent; only the blend is ordered. No upstream file is edited: apply_decode_parallel(vae,
devices) returns a VAE whose decode_temporal

1. plans the chunks as upstream does (its _decode_temporal_chunks, the same padding and slices),
2. decodes them in waves of P: chunk i on rank i % P, rank 0 in the calling thread and ranks 1..P-1 in
   worker threads on replicas of the VAE (views of the one host copy, comfy.multinpu_weights),
3. runs upstream's decode_temporal unchanged, whose _adaptive_decode now hands back the decoded chunks
   in order, each copied to rank 0's device when the blend asks for it. The blend, the conversion to
   pixels and the writes into the output buffer are upstream's own code, in upstream's order, on the
   device where one-device decoding runs them.

Each chunk is decoded by the same code on the same kind of device from the same latents, so the video is
bit-identical to the one-device decode (h3kit parity --component vae gates max_abs == 0). At most one
wave of decoded chunks exists at a time, each on the device that decoded it. Encoding (reference images,
keyframes) and single-frame decodes stay on rank 0.

With the process transport (comfy.multinpu_process) the ranks are worker processes, rank 0 included: the
server hands the planned chunks to the group, every worker decodes its chunks (i % P == its rank) on the VAE
it loaded from the same file, worker rank 0 gathers them in order and hands them back through shared
memory, and the server blends them as above (all the decoded chunks are on the host at once there). A
single-frame decode goes to worker rank 0 as one chunk. The server computes no decode, so its copy holds
only what it runs, the encoder (reference images, keyframes) and the latent and pixel statistics, and the
workers hold only the decoder (and its post-quant convolution): device 0 holds each weight once.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
import weakref
from typing import TYPE_CHECKING

import torch

import comfy.ldm.minimax.vae
import comfy.model_management
import comfy.multidevice
import comfy.multinpu
import comfy.multinpu_group
import comfy.multinpu_models
import comfy.multinpu_process
import comfy.multinpu_weights

if TYPE_CHECKING:
    from comfy.sd import VAE

KEY = "multinpu_video_vae"  # the VAE patcher's transformer_options["patches"] entry that brings the replicas


def plan_chunks(vae, z: torch.Tensor) -> list:
    """The latent chunks decode_temporal decodes, in order: [B, C, 7, h, w] slices of the padded z."""
    pad_tokens, num_chunks = vae._decode_temporal_chunks(z.shape[2])
    if pad_tokens > 0:
        z = torch.cat([z, z[:, :, -1:, :, :].repeat(1, 1, pad_tokens, 1, 1)], dim=2)
    size = vae.tokens_chunk_size
    return [z[:, :, i * size:i * size + size + vae.token_overlap, :, :] for i in range(num_chunks)]


def take_latents(chunk: torch.Tensor, comm) -> torch.Tensor:
    """Rank comm.rank's own copy of the latent chunk it decodes (rank 0 decodes the planned slice itself)."""
    return chunk if comm.rank == 0 else chunk.to(comm.device, copy=True)


def fetch_chunk(chunk: torch.Tensor, device: torch.device, src_rank: int) -> torch.Tensor:
    """A decoded chunk from the device of rank src_rank onto rank 0's `device` (a real copy, also when
    both are the same device in the CPU simulation, so no rank ever aliases another's output)."""
    return chunk if src_rank == 0 else chunk.to(device, copy=True)


class _ChunkStream:
    """One decode_temporal call's chunks: decoded a wave ahead, handed back in order."""

    def __init__(self, runner: VideoDecodeParallel, vae0, chunks: list):
        self.runner = runner
        self.vae0 = vae0
        self.chunks = chunks
        self.next = 0
        self.ready = {}  # index -> (rank, decoded chunk); processes: every chunk, from the workers

    def take(self, z: torch.Tensor) -> torch.Tensor:
        i = self.next
        if i >= len(self.chunks) or z.shape != self.chunks[i].shape or not torch.equal(z, self.chunks[i]):
            # upstream's chunk plan changed under us: refuse rather than blend the wrong chunks
            raise RuntimeError(f"MultiNPU: the VAE asked for a chunk (#{i}, {tuple(z.shape)}) that the parallel "
                               f"plan of {len(self.chunks)} chunks does not have at that place")
        if i not in self.ready:
            self.ready = self.runner.decode_wave(self.vae0, self.chunks, i)
        self.next += 1
        rank, chunk = self.ready.pop(i)
        self.runner.bytes_moved += 0 if rank == 0 else chunk.numel() * chunk.element_size()
        return fetch_chunk(chunk, z.device, rank)


class VideoDecodeParallel:
    """Decodes waves of chunks on all ranks: rank r decodes on replicas[r] (replicas[0] is rank 0's VAE).

    forwards counts decode_temporal calls, chunks the chunks decoded, bytes_moved the bytes of decoded
    chunks copied to rank 0, chunk_ranks the rank that decoded each chunk of the last call.
    """

    def __init__(self, devices, replicas, timeout: float = comfy.multinpu.DEFAULT_TIMEOUT, runtime=None,
                 config=None):
        self.devices = list(devices)
        self.replicas = list(replicas)
        self.timeout = timeout
        self.runtime = runtime  # processes: rank 0's comfy.multinpu_process runtime; config: what workers load
        self.config = config
        self.forwards = 0
        self.chunks = 0
        self.single_frames = 0  # processes: single-frame decodes worker rank 0 ran
        self.bytes_moved = 0
        self.chunk_ranks = []
        self._threads = None
        self._lock = threading.Lock()

    def _pool(self):
        if self._threads is None or self._threads.broken:
            self._threads = comfy.multinpu.RankThreads(self.devices, set_device=comfy.multidevice.set_device,
                                                       name="multinpu-vae")
            weakref.finalize(self, self._threads.shutdown)
        return self._threads

    def decode_wave(self, vae0, chunks: list, first: int) -> dict:
        """Decode chunks first .. first+P-1 (as many as exist), chunk first+r on rank r: {index: (rank, pixels)}."""
        group = comfy.multinpu.ThreadGroup(self.devices, timeout=self.timeout)

        def rank_decode(comm):
            i = first + comm.rank
            z = take_latents(chunks[i], comm) if i < len(chunks) else None
            # the workers copy their latents from rank 0's device before rank 0 queues its decode there:
            # their copies would otherwise wait behind it, and the wave would decode one chunk at a time
            comfy.multinpu.barrier(comm)
            if z is None:
                return None
            vae = vae0 if comm.rank == 0 else self.replicas[comm.rank]
            # upstream's chunk decode (spatial tiles inside), not the override that hands chunks back
            out = comfy.ldm.minimax.vae.MiniMaxH3VideoVAE._adaptive_decode(vae, z)
            # rank 0 reads it from another thread: the kernels that wrote it must have finished
            comfy.multidevice.synchronize(comm.device)
            return out

        # the other ranks copy their latents from rank 0's device in their own threads
        comfy.multidevice.synchronize(self.devices[0])
        outs = group.run(rank_decode, self._pool())
        self.chunks += sum(o is not None for o in outs)
        self.chunk_ranks += [r for r, o in enumerate(outs) if o is not None]
        return {first + r: (r, o) for r, o in enumerate(outs) if o is not None}

    def decode_in_workers(self, z: torch.Tensor) -> torch.Tensor:
        """Processes: a decode outside decode_temporal (a single frame), upstream's _adaptive_decode on worker rank
        0 (the server's copy holds no decoder); the pixels come back onto z's device."""
        with self._lock:
            (out,) = self.runtime.run("vae_decode", {"config": self.config.id, "chunks": [z]}, configs=[self.config])
        self.single_frames += 1
        return out.to(z.device)

    def decode_temporal(self, vae0, z, output_buffer):
        chunks = plan_chunks(vae0, z)
        stream = _ChunkStream(self, vae0, chunks)
        self.chunk_ranks = []
        t0 = time.perf_counter()

        def blend():
            vae0.__dict__["_multinpu_stream"] = stream
            try:
                return comfy.ldm.minimax.vae.MiniMaxH3VideoVAE.decode_temporal(vae0, z, output_buffer)
            finally:
                vae0.__dict__.pop("_multinpu_stream", None)

        with self._lock:
            if self.runtime is None:
                out = blend()
            else:
                # every rank is a worker: chunk i decoded on rank i % P, all of them handed back by rank 0 in
                # order; the blend runs here, upstream's code on the chunks as one-device decoding would
                world = self.runtime.world_size
                decoded = self.runtime.run("vae_decode", {"config": self.config.id, "chunks": chunks},
                                           configs=[self.config])
                self.chunk_ranks = [i % world for i in range(len(chunks))]
                self.chunks += len(chunks)
                stream.ready = {i: (i % world, c) for i, c in enumerate(decoded)}
                out = blend()
        if stream.next != len(chunks):
            raise RuntimeError(f"MultiNPU: the VAE blended {stream.next} of the {len(chunks)} chunks it planned")
        self.forwards += 1
        logging.debug(f"MultiNPU: video VAE decode of {len(chunks)} chunks on {len(self.devices)} devices in "
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
    """Where a copy of the VAE leaves out a part another process runs: no weights, the attributes upstream reads
    (the decoder's out_channels), and a forward that refuses."""

    def __init__(self, what: str, where: str, **attributes):
        super().__init__()
        self.what, self.where = what, where
        self.__dict__.update(attributes)

    def forward(self, *args, **kwargs):
        raise RuntimeError(f"MultiNPU: the video VAE's {self.what} runs in {self.where}, not here")


def server_model(source):
    """The server's video VAE with the process transport: the encoder, the quant convolution and the statistics
    (buffers), what the server computes; the decoder and its post-quant convolution are left to the workers."""
    return comfy.multinpu_weights.share_module(source, replace=[
        (source.decoder, _InWorkers("decoder", "the worker processes", out_channels=source.decoder.out_channels)),
        (source.post_quant_conv, _InWorkers("post-quant convolution", "the worker processes"))])


def worker_model(source):
    """A worker's video VAE: the decoder side only (the server encodes)."""
    return comfy.multinpu_weights.share_module(source, replace=[
        (source.encoder, _InWorkers("encoder", "the server")),
        (source.quant_conv, _InWorkers("quant convolution", "the server"))])


class _WorkerVAE:
    """A worker's video VAE for one configuration: the decoder side of the one it loaded, and its patcher."""

    def __init__(self, model, patcher, digest):
        self.model = model
        self.patcher = patcher
        self.digest = digest


@comfy.multinpu_group.program("vae_config")
def _load_on_worker(context, comm, payload):
    src = payload["source"]
    vae = comfy.multinpu_models.load(src)
    comfy.multinpu_models.map_file_weights(vae.first_stage_model, src.paths)
    comfy.multinpu_weights.anchor_host_copy(vae.first_stage_model)
    model = worker_model(vae.first_stage_model)
    comfy.multinpu_weights.reset_load_state(model)
    patcher = comfy.multinpu_weights.device_patcher(vae.patcher, model, vae.device)
    return _WorkerVAE(model, patcher, comfy.multinpu_models.digest(src, vae.first_stage_model))


@comfy.multinpu_group.program("vae_decode")
def _decode_on_worker(context, comm, payload):
    """Chunk i on rank i % P; rank 0 returns every decoded chunk in order, each moved to the host as it
    arrives (they reach the server through shared memory; the device holds one wave at a time)."""
    held = context.configs[payload["config"]]
    comfy.model_management.load_models_gpu([held.patcher])
    chunks = payload["chunks"]

    def decode(i):
        z = chunks[i].to(held.patcher.load_device)
        return comfy.ldm.minimax.vae.MiniMaxH3VideoVAE._adaptive_decode(held.model, z)

    if comm.rank != 0:
        for i in range(comm.rank, len(chunks), comm.world_size):
            _send_chunk(comm, decode(i))
        return None
    return [(decode(i) if i % comm.world_size == 0 else _recv_chunk(comm, i % comm.world_size)).cpu()
            for i in range(len(chunks))]


class ParallelVideoVAE(comfy.ldm.minimax.vae.MiniMaxH3VideoVAE):
    """Rank 0's video VAE: decode_temporal spreads the chunk decodes over the devices (VideoDecodeParallel)."""

    def decode_temporal(self, z, output_buffer=None):
        return self.multinpu.decode_temporal(self, z, output_buffer)

    def _adaptive_decode(self, z):
        stream = self.__dict__.get("_multinpu_stream")
        if stream is not None:
            return stream.take(z)
        if self.multinpu.runtime is not None:
            return self.multinpu.decode_in_workers(z)
        return super()._adaptive_decode(z)


def apply_decode_parallel(vae: VAE, devices, timeout: float = comfy.multinpu.DEFAULT_TIMEOUT, runtime=None) -> VAE:
    """A copy of `vae` (a MiniMax H3 video VAE) that decodes on `devices` (rank 0 = devices[0], where it loads),
    or on the processes of `runtime` (devices ignored: every worker loads the same file and keeps its decoder;
    the copy, which loads onto the VAE's device, keeps the encoder and decodes nothing itself).

    The replicas for devices[1:] share the loaded host weights and load onto their devices with the VAE
    (load_models_gpu, upstream memory management). Raises ValueError for any other VAE (the audio VAE
    stays on one device, in fp32).
    """
    devices = [torch.device(d) for d in devices] if runtime is None else [vae.device]
    source = vae.first_stage_model
    if type(source) is not comfy.ldm.minimax.vae.MiniMaxH3VideoVAE:
        what = "already split across devices" if isinstance(source, ParallelVideoVAE) else f"a {type(source).__name__}"
        raise ValueError(f"MultiNPU: parallel decode is for the MiniMax H3 video VAE; this VAE is {what}")
    src = comfy.multinpu_models.source(source, "VAE") if runtime is not None else None
    # the loaded weights, back on the host, are the one host copy every replica shares
    comfy.model_management.unload_model_and_clones(vae.patcher, all_devices=True)
    if src is not None:
        comfy.multinpu_models.map_file_weights(source, src.paths)
    comfy.multinpu_weights.anchor_host_copy(source)

    replicas = []
    for _ in devices:
        # processes: the server's one copy keeps the encoder side, the workers decode
        r = comfy.multinpu_weights.share_module(source) if runtime is None else server_model(source)
        comfy.multinpu_weights.reset_load_state(r)
        replicas.append(r)
    config = None
    if runtime is not None:
        config = comfy.multinpu_process.RemoteConfig("vae_config", {"source": src},
                                                     comfy.multinpu_models.digest(src, source), f"VAE {src.paths[0]}")
    runner = VideoDecodeParallel(devices, replicas, timeout, runtime, config)
    replicas[0].__class__ = ParallelVideoVAE
    replicas[0].multinpu = runner

    n = copy.copy(vae)  # the VAE's settings (dtypes, memory estimates, strides) are shared, read-only
    n.first_stage_model = replicas[0]
    n.patcher = comfy.multinpu_weights.device_patcher(vae.patcher, replicas[0], devices[0])
    others = [comfy.multinpu_weights.device_patcher(vae.patcher, r, d) for r, d in zip(replicas[1:], devices[1:])]
    comfy.multinpu_weights.attach_device_models(n.patcher, KEY, others)
    if runtime is not None:
        where = f"{runtime.world_size} processes"
        held = (f"every worker holds the decoder, the server the encoder, {n.patcher.model_size() / 2**30:.2f} of "
                f"{vae.patcher.model_size() / 2**30:.2f} GiB")
    else:
        where = comfy.multidevice.describe_devices(devices)
        held = f"every device holds the VAE, {vae.patcher.model_size() / 2**30:.2f} GiB"
    logging.info(f"MultiNPU: video VAE decodes temporal chunks on {where} ({held})")
    return n


def get_runner(vae: VAE):
    """The VideoDecodeParallel of a VAE set up by apply_decode_parallel, or None."""
    model = getattr(vae, "first_stage_model", None)
    return model.multinpu if isinstance(model, ParallelVideoVAE) else None
