"""Decoder layers' weights, read ahead of the layer that runs: one background thread, one layer ahead.

`LayerReader` hands out, in order, each layer's parameters as tensors on the compute device in the compute dtype,
read with `Checkpoint.read` (memory-mapped; a ``model+lora`` adapter merged in as read). While layer l runs, a
thread prepares layer l+1 (``prefetch``):

- on the CPU it reads l+1 (a ``model+lora`` adapter's merge runs there) and pages its bytes into the page cache
  with plain reads of the file, 8 MiB at a time (no torch and no GIL held while the disk works), so casting l+1
  later reads memory, not the disk. The cast itself happens
  when l+1 is taken, after l was released: one layer of private memory at a time (none when the checkpoint is
  stored in the compute dtype: the layer then runs on the mapped file, as ``from_pretrained`` leaves it).
- on a GPU it copies l+1's tensors into pinned host memory and from there to the GPU on a side stream
  (``non_blocking``), casting them there; an event orders their first use after the copy. Two layers are on
  the GPU at once: the one running and the one arriving.

Without prefetch, each layer is read when it is taken. It runs no layer (`stream` does) and reads no tensor but
the ones it is given; while its thread lives, nothing else may read the checkpoint (the thread does).
"""

from __future__ import annotations

import os
import queue
import threading
from typing import Optional

import torch

from moe_upcycle.checkpoint.source import Checkpoint

PAGE_IN_CHUNK = 8 << 20  # bytes per read while paging a layer in
AHEAD = 1  # layers prepared beyond the one running


class LayerReader:
    """Layers' parameters, in the order given, prepared one ahead by a thread.

    Example:
        >>> with LayerReader(ckpt, [{"mlp.up_proj.weight": "model.layers.0.mlp.up_proj.weight"}], torch.float32,
        ...                  torch.device("cpu")) as reader:  # doctest: +SKIP
        ...     params = reader.take()  # {"mlp.up_proj.weight": fp32 tensor}
        ...     del params; reader.release()
    """

    def __init__(self, checkpoint: Checkpoint, layers: list[dict[str, str]], dtype: torch.dtype,
                 device: torch.device, prefetch: bool = True):
        """
        Args:
            checkpoint: where the tensors are read.
            layers: per layer to hand out, in order: parameter name -> checkpoint key.
            dtype: the compute dtype every tensor is cast to.
            device: the compute device.
            prefetch: prepare the next layer in a thread while the caller runs the current one.
        """
        self.checkpoint, self.layers, self.dtype, self.device = checkpoint, layers, dtype, device
        self.cuda = device.type == "cuda"
        self.taken = 0
        self._ready: queue.Queue = queue.Queue()
        self._slots = threading.Semaphore(1 + AHEAD)  # layers taken and not released, plus those prepared
        self._stop = threading.Event()
        self._side = torch.cuda.Stream(device) if self.cuda and prefetch else None
        self._thread: Optional[threading.Thread] = None
        self._taken: dict[str, torch.Tensor] = {}  # the CPU casts of the layer taken last
        self._spare: dict[str, torch.Tensor] = {}  # ... once released: the next layer is cast into them
        if prefetch and layers:
            self._thread = threading.Thread(target=self._prepare_all, name="moe-upcycle layer reader", daemon=True)
            self._thread.start()

    def __enter__(self) -> "LayerReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def take(self) -> dict[str, torch.Tensor]:
        """The next layer's parameters on the device, in the compute dtype. Release it (`release`) before the next
        take, after dropping every reference to it: that is what keeps one layer in memory.

        Raises:
            UpcycleError: (and anything else) what reading the layer raised, in this thread.
        """
        index = self.taken
        self.taken += 1
        if self._thread is None:
            return self._finish(self._prepare(self.layers[index]))
        got, item = self._ready.get()
        if got == "error":
            raise item
        return self._finish(item)

    def release(self) -> None:
        """The layer taken last is no longer referenced: the thread may prepare another."""
        self._spare, self._taken = self._taken, {}
        self._slots.release()

    def close(self) -> None:
        """Stop the thread (it ends within one read of `PAGE_IN_CHUNK` bytes on the CPU, one layer on a GPU)."""
        self._stop.set()
        self._slots.release()
        if self._thread is not None:
            self._thread.join(timeout=60)
            self._thread = None

    # ----------------------------------------------------------------------------------------- the thread

    def _prepare_all(self) -> None:
        for keys in self.layers:
            self._slots.acquire()
            if self._stop.is_set():
                return
            try:
                self._ready.put(("ok", self._prepare(keys)))
            except BaseException as exc:  # handed to the caller, raised by `take`
                self._ready.put(("error", exc))
                return

    def _prepare(self, keys: dict[str, str]):
        """The layer's tensors as read (mapped views; adapted ones merged) and, on a GPU, copied there in the compute
        dtype; with the event their copy records (None on the CPU, or without a side stream)."""
        host = {name: self.checkpoint.read(key) for name, key in keys.items()}
        if not self.cuda:
            if self._thread is not None:
                self._page_in(keys.values())
            return host, None
        if self._side is None:
            return {name: t.to(self.device).to(self.dtype) for name, t in host.items()}, None
        with torch.cuda.stream(self._side):
            out = {}
            for name, t in host.items():
                pinned = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                pinned.copy_(t)  # from the mapped file: the page faults happen here, in this thread
                # queued on the side stream; the host allocator keeps `pinned` until the copy is done
                out[name] = pinned.to(self.device, non_blocking=True).to(self.dtype)
            done = torch.cuda.Event()
            done.record(self._side)
        return out, done

    def _finish(self, item) -> dict[str, torch.Tensor]:
        tensors, done = item
        if not self.cuda:  # cast here, after the previous layer was released: one layer of private memory
            out = {name: self._in_dtype(name, t) for name, t in tensors.items()}
            self._spare = {}
            return out
        if done is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(done)
            for t in tensors.values():
                t.record_stream(stream)  # made on the side stream, used (and freed) on this one
        return tensors

    def _in_dtype(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` in the compute dtype: cast into the released layer's buffer of that name (fresh memory would
        cost a page fault per 4 KiB of every layer); or, already in that dtype, the mapped view itself — as
        ``from_pretrained`` keeps it: no private copy, and the kernels see the same memory, so the same numbers."""
        if tensor.dtype == self.dtype:
            return tensor
        buffer = self._spare.pop(name, None)
        if buffer is None or buffer.shape != tensor.shape:
            buffer = torch.empty(tensor.shape, dtype=self.dtype)
        self._taken[name] = buffer.copy_(tensor)
        return buffer

    def _page_in(self, keys) -> None:
        """Read the bytes of the tensors `keys` into the page cache (those of mapped safetensors files)."""
        buffer = bytearray(PAGE_IN_CHUNK)
        for key in keys:
            info = self.checkpoint.tensors[key]
            if not info.file.endswith(".safetensors") or info.offset < 0 or self.checkpoint.path is None:
                continue
            try:
                fd = os.open(self.checkpoint.path / info.file, os.O_RDONLY)
            except OSError:
                continue  # `Checkpoint.read` says what is wrong with the file
            try:
                end = info.offset + info.nbytes
                for start in range(info.offset, end, PAGE_IN_CHUNK):
                    if self._stop.is_set():
                        return
                    view = memoryview(buffer)[:min(PAGE_IN_CHUNK, end - start)]
                    if os.preadv(fd, [view], start) <= 0:
                        break
            finally:
                os.close(fd)


