"""Tensor frames: activations and gradients between pipeline neighbours, over ZeroMQ.

Wire layout of one tensor: one ZeroMQ multipart message::

    part 0      msgpack [PROTOCOL_VERSION, "tensor", {TensorHeader fields}, nframes]   (< 4 KiB)
    part 1..n   the tensor's bytes in C order, native (little-endian) byte order, split into
                `nframes` parts of CHUNK_BYTES (1 MiB) each, the last one shorter;
                no data part at all for an empty tensor

`stage` in the header is the sender's stage, `direction` is "act" (forward, to stage+1), "grad"
(backward, to stage-1) or "stats" (a step's statistics on their way to agreement, to or from any
worker of the job; `micro_batch` then holds the sender's rank). `dtype` is the torch name without
the `torch.` prefix (bfloat16 travels as its raw bytes; numpy is never asked to understand it).

Why split: a 64 MiB tensor sent as one part makes the receiving ZeroMQ I/O thread allocate 64 MiB at
once (a fresh mmap, page-faulted 4 KiB at a time); that reaches about a third of what the socket can do.
1 MiB parts come from malloc's recycled heap, and the receiver copies each one straight into the
tensor's buffer (`recv_into`) and hands it back at once.

Costs: parts of ZERO_COPY_MIN_BYTES (64 KiB) and more are sent zero-copy: pyzmq holds the buffer
object, which holds the tensor, until ZeroMQ's I/O thread has written the part, so `send_tensor`
returns at once. The caller must therefore not modify the tensor in place after sending it (send a
clone if it must). The receiver copies the parts once into one buffer allocated through numpy, which
asks the kernel for transparent huge pages (a 64 MiB buffer then costs a few hundred page faults
instead of 16384). A tensor that fits one part is not copied at all: `torch.frombuffer` wraps ZeroMQ's own
buffer (copied only in the rare case it is not aligned to the element size). ZeroMQ delivers a
multipart message whole, so the receiver's copy of a tensor overlaps the transfer of the next tensor,
not its own.

Header caches: a pipeline sends the same few headers every step (one per micro-batch and direction),
and building, checking and packing one, or unpacking and checking it, costs more CPU than moving an
8 KiB activation. The sender keeps the packed bytes per (job, epoch, stage, micro-batch, direction,
dtype, shape), built and validated by TensorHeader the first time; the receiver keeps the decoded,
validated header per received header bytes (decoding is a pure function of the bytes, so identical
bytes stand for an identical header). Only valid headers are kept; anything new is checked in full.
Both caches are bounded (cleared when full) and shared by all sockets of the process.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import zmq

from protocol.errors import MessageValueError, ProtocolError
from protocol.messages import (
    _ID,
    _RANK,
    PROTOCOL_VERSION,
    _dump_record,
    _f,
    _Int,
    _load_record,
    _pack,
    _Record,
    _short,
    _Str,
    _Tuple,
    _unpack,
)

__all__ = [
    "CHUNK_BYTES",
    "DIRECTIONS",
    "DTYPES",
    "ZERO_COPY_MIN_BYTES",
    "TensorHeader",
    "recv_tensor",
    "send_tensor",
]

DIRECTIONS = ("act", "grad", "stats")   # activation forward, gradient backward, step statistics
CHUNK_BYTES = 1 << 20
ZERO_COPY_MIN_BYTES = 64 << 10  # below this a memcpy is cheaper than pyzmq's zero-copy bookkeeping

_TAG = "tensor"
_MAX_HEADER_BYTES = 4096
_MAX_DIMS = 64
_MAX_NBYTES = 1 << 40

_DTYPE_NAMES = (
    "float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8",
    "bool", "complex64", "complex128", "uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2",
)
# Plain dtypes only: every byte pattern of these is a valid value except bool's (checked on receive).
DTYPES: dict[str, torch.dtype] = {n: getattr(torch, n) for n in _DTYPE_NAMES if hasattr(torch, n)}
_NAME_OF = {dtype: name for name, dtype in DTYPES.items()}

_CACHE_ENTRIES = 1024           # per cache; a step uses 2 x micro-batches headers per channel
_CACHE_MAX_HEAD = 512           # header bytes worth keeping (a long job name or many dims: no cache)
_SENT: dict[tuple, tuple[bytes, int]] = {}                 # header key -> (packed header, nframes)
_RECEIVED: dict[bytes, tuple["TensorHeader", int, torch.dtype]] = {}   # header bytes -> decoded


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorHeader(_Record):
    """What a tensor frame says about the tensor that follows it."""

    job: str = _f(_ID)
    epoch: int = _f(_Int())
    stage: int = _f(_RANK)
    micro_batch: int = _f(_RANK)
    direction: str = _f(_Str(8))
    dtype: str = _f(_Str(32))
    shape: tuple[int, ...] = _f(_Tuple(_Int(0, _MAX_NBYTES), max_items=_MAX_DIMS))
    nbytes: int = _f(_Int(0, _MAX_NBYTES))

    def _validate(self) -> None:
        if self.direction not in DIRECTIONS:
            raise MessageValueError(f"TensorHeader.direction must be one of {DIRECTIONS}, got {_short(self.direction)}")
        if self.dtype not in DTYPES:
            raise MessageValueError(
                f"TensorHeader.dtype {_short(self.dtype)} is not supported; use one of {', '.join(DTYPES)}")
        expected = math.prod(self.shape) * DTYPES[self.dtype].itemsize
        if self.nbytes != expected:
            raise MessageValueError(
                f"TensorHeader.nbytes is {self.nbytes} but {self.dtype} of shape {self.shape} needs {expected}")


def _frame_count(nbytes: int) -> int:
    return -(-nbytes // CHUNK_BYTES)


def _flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU uint8 view of the tensor's values (a copy only when it has to be one)."""
    if tensor.layout != torch.strided:
        raise MessageValueError(f"only dense tensors can be sent, got layout {tensor.layout}")
    t = tensor.detach()
    if not t.is_cpu:
        t = t.cpu()
    # Lazy conjugate/negative views would otherwise send the un-negated bytes. (The checks are
    # cheaper than the no-op resolve/contiguous calls for the usual dense contiguous tensor.)
    if t.is_conj() or t.is_neg() or not t.is_contiguous():
        t = t.resolve_conj().resolve_neg().contiguous()
    return t.reshape(-1).view(torch.uint8)


def send_tensor(sock: zmq.Socket, tensor: torch.Tensor, *, job: str, epoch: int, stage: int,
                micro_batch: int, direction: str, flags: int = 0) -> None:
    """Queue `tensor` on `sock` as one multipart message and return without waiting for the network.

    `stage` is the sender's stage. Non-contiguous and CUDA tensors are copied to contiguous CPU
    memory first; others are sent zero-copy, so do not modify them in place afterwards. Raises
    MessageValueError (a ProtocolError) for a bad header field or an unsupported dtype or layout,
    and whatever zmq raises (zmq.Again with NOBLOCK in `flags` when the socket is full; nothing is
    sent then).
    """
    name = _NAME_OF.get(tensor.dtype)
    if name is None:
        raise MessageValueError(f"dtype {tensor.dtype} cannot be sent; use one of {', '.join(DTYPES)}")
    flat = _flat_bytes(tensor)
    head, nframes = _head(job, epoch, stage, micro_batch, direction, name, tuple(tensor.shape), flat.numel())
    if nframes == 0:
        sock.send(head, flags)
        return
    sock.send(head, flags | zmq.SNDMORE)
    # ZeroMQ accepts the rest of a message once its first part is in, so later parts never hit
    # EAGAIN; dropping NOBLOCK makes sure a message is never left half sent.
    flags &= ~zmq.NOBLOCK
    # The memoryview's exporter is a numpy array whose base is `flat`, which owns (or views) the
    # tensor's storage: every slice handed to zmq keeps that memory alive until zmq frees the part.
    view = memoryview(flat.numpy())
    if nframes == 1:
        sock.send(view, flags, copy=len(view) < ZERO_COPY_MIN_BYTES)
        return
    last = nframes - 1
    for i in range(nframes):
        part = view[i * CHUNK_BYTES:(i + 1) * CHUNK_BYTES]
        sock.send(part, flags if i == last else flags | zmq.SNDMORE, copy=len(part) < ZERO_COPY_MIN_BYTES)


def _head(job, epoch, stage, micro_batch, direction, name: str, shape: tuple, nbytes: int) -> tuple[bytes, int]:
    """The packed header part and the number of data parts. The TensorHeader checks every field
    the first time; its bytes are then reused for the same arguments (exact types only, so that
    e.g. True or 1.0 never reuse the bytes of 1 and are refused as before)."""
    key = (job, epoch, stage, micro_batch, direction, name, shape)
    exact = (type(job) is str and type(epoch) is int and type(stage) is int and type(micro_batch) is int
             and type(direction) is str)
    if exact:
        hit = _SENT.get(key)
        if hit is not None:
            return hit
    header = TensorHeader(job=job, epoch=epoch, stage=stage, micro_batch=micro_batch,
                          direction=direction, dtype=name, shape=shape, nbytes=nbytes)
    nframes = _frame_count(nbytes)
    hit = (_pack([PROTOCOL_VERSION, _TAG, _dump_record(header), nframes]), nframes)
    if exact and len(hit[0]) <= _CACHE_MAX_HEAD:
        if len(_SENT) >= _CACHE_ENTRIES:
            _SENT.clear()
        _SENT[key] = hit
    return hit


def _drain(sock: zmq.Socket) -> None:
    # Swallow the rest of a refused message so the next recv starts at a message boundary.
    while sock.get(zmq.RCVMORE):
        sock.recv(copy=False)


def _decode_header(data: bytes) -> tuple[TensorHeader, int]:
    obj = _unpack(data, _MAX_HEADER_BYTES, "tensor header")
    if not isinstance(obj, list) or len(obj) != 4:
        raise ProtocolError("a tensor header must be a msgpack array [version, 'tensor', fields, nframes]")
    version, tag, body, nframes = obj
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"tensor frame of protocol version {_short(version)}, not {PROTOCOL_VERSION}; "
            "run the same varunad release on every worker")
    if tag != _TAG:
        raise ProtocolError(f"expected a tensor header, got type {_short(tag)}")
    try:
        header = _load_record(TensorHeader, body, "TensorHeader")
    except MessageValueError as exc:
        raise ProtocolError(f"bad tensor header: {exc.reason}") from None
    if isinstance(nframes, bool) or not isinstance(nframes, int) or nframes != _frame_count(header.nbytes):
        raise ProtocolError(
            f"tensor header announces {_short(nframes)} data parts for {header.nbytes} bytes; "
            f"expected {_frame_count(header.nbytes)} parts of {CHUNK_BYTES} bytes")
    return header, nframes


def _decoded(head: bytes) -> tuple[TensorHeader, int, torch.dtype]:
    """`_decode_header` through the cache of valid headers (ProtocolError for a bad one)."""
    hit = _RECEIVED.get(head)
    if hit is None:
        header, nframes = _decode_header(head)
        hit = (header, nframes, DTYPES[header.dtype])
        if len(head) <= _CACHE_MAX_HEAD:
            if len(_RECEIVED) >= _CACHE_ENTRIES:
                _RECEIVED.clear()
            _RECEIVED[head] = hit
    return hit


def recv_tensor(sock: zmq.Socket, flags: int = 0) -> tuple[TensorHeader, torch.Tensor]:
    """Receive one tensor frame from `sock`: its header and a CPU tensor of the announced dtype/shape.

    Raises ProtocolError for anything malformed (the whole message is consumed, so the socket stays
    usable), zmq.Again with NOBLOCK in `flags` (or when the socket's RCVTIMEO passes) when nothing
    is waiting.
    """
    head = sock.recv(flags)
    try:
        header, nframes, dtype = _decoded(head)
        if nframes == 1:
            flat = _recv_single(sock, header, dtype)
        elif nframes == 0:
            flat = torch.empty(0, dtype=torch.uint8)
            _expect_end(sock, nframes)
        else:
            flat = _recv_chunks(sock, header, nframes)
    except ProtocolError:
        _drain(sock)
        raise
    if dtype is torch.bool and bool((flat > 1).any()):
        raise ProtocolError("a bool tensor holds bytes other than 0 and 1")
    return header, flat.view(dtype).reshape(header.shape)


def _expect_end(sock: zmq.Socket, nframes: int) -> None:
    if sock.get(zmq.RCVMORE):
        raise ProtocolError(f"tensor frame has more than the {nframes} data parts its header announces")


def _next_part(sock: zmq.Socket, index: int, nframes: int) -> None:
    if not sock.get(zmq.RCVMORE):
        raise ProtocolError(f"tensor frame has {index} data parts; its header announces {nframes}")


def _recv_single(sock: zmq.Socket, header: TensorHeader, dtype: torch.dtype) -> torch.Tensor:
    # Wrap ZeroMQ's own buffer: no copy. The tensor keeps the frame alive through the memoryview.
    _next_part(sock, 0, 1)
    part = sock.recv(copy=False)
    if part.more:
        raise ProtocolError("tensor frame has more than the 1 data parts its header announces")
    if len(part) != header.nbytes:
        raise ProtocolError(f"tensor data part has {len(part)} bytes; its header announces {header.nbytes}")
    flat = torch.frombuffer(part.buffer, dtype=torch.uint8)
    # ZeroMQ's buffers are 8-byte aligned at best, and small parts sit at any offset of its receive
    # batch. Elements must at least be naturally aligned; copy the few that are not.
    return flat.clone() if flat.data_ptr() % dtype.itemsize else flat


def _recv_chunks(sock: zmq.Socket, header: TensorHeader, nframes: int) -> torch.Tensor:
    # One buffer for the whole tensor, from numpy because numpy asks the kernel for huge pages.
    # Each part is copied straight into it and released at once, so ZeroMQ's I/O thread gets the
    # same memory back for the next part. A header lying about its size costs only address space:
    # the pages are touched as parts arrive, and a short message is refused.
    try:
        buf = np.empty(header.nbytes, dtype=np.uint8)
    except MemoryError:
        raise ProtocolError(f"cannot allocate {header.nbytes} bytes for a tensor") from None
    view = memoryview(buf)
    for i in range(nframes):
        _next_part(sock, i, nframes)
        start = i * CHUNK_BYTES
        want = min(CHUNK_BYTES, header.nbytes - start)
        got = sock.recv_into(view[start:start + want])
        if got != want:
            raise ProtocolError(
                f"tensor data part {i} has {got} bytes; expected {want} (parts of {CHUNK_BYTES} bytes "
                f"adding up to {header.nbytes})")
    _expect_end(sock, nframes)
    return torch.from_numpy(buf)
