"""Streaming a swap set through the bounded staging slots, chunk by chunk.

[Note: bounded staging]
The NVMe store's host memory is its slot pool: ``buffer_count`` buffers (raised to what the
pipeline needs at once: the step's read-ahead and write-back, stage 3's gathers in flight) of
at most ``buffer_size`` bytes each, whatever the model. A swap set (one flat group's master
and optimizer state, or its parameter shard) that fits in a slot visits one whole, as
before. A larger one (a language model's embeddings or LM head, or a large root group, can
be a large share of the model) never gets a buffer of its size: it is *streamed*, DeepSpeed's
``sub_group_size`` idea. The optimizer step reads chunk i+1 of every tensor of the set while
it steps chunk i and writes chunk i-1 back; a stage-3 gather reads the parameter shard chunk
by chunk into the gathered buffer; a new parameter shard is written chunk by chunk. A chunk
is the same element range [a, b) of each tensor of the set, so the elementwise optimizer
sees matching slices of master, gradient and moments (see _optim/chunked_step.py for why
that step is exact). Chunks start at multiples of ``ALIGN_ELEMS`` elements, so every
request's offset in the file stays 4096-byte aligned (O_DIRECT) for 2- and 4-byte dtypes;
a slot therefore holds at least ``ALIGN_ELEMS`` elements of each tensor, 24 KiB for AdamW,
even where ``buffer_size`` is smaller. Only a caller that needs a large set whole (a
checkpoint, a full state dict) gets a buffer of its size (``SlotPool.acquire_private``),
counted in the working set and freed when it is done.
"""

from __future__ import annotations

from typing import Iterator

import torch

from .aligned import round_up
from .swap_file import wait_all

#: chunk boundaries, in elements (see [Note: bounded staging])
ALIGN_ELEMS = 2048


def chunk_elems(slot_bytes: int | None, bytes_per_elem: int, numel: int) -> int:
    """Elements per chunk: as many as fit in a slot with ``bytes_per_elem`` bytes for each
    (the sum over the set's tensors), a multiple of ``ALIGN_ELEMS``, at least one multiple."""
    if slot_bytes is None:
        return max(numel, 1)
    fit = slot_bytes // max(bytes_per_elem, 1) // ALIGN_ELEMS * ALIGN_ELEMS
    return max(fit, ALIGN_ELEMS)


def _layout(meta: dict, a: int, b: int) -> tuple[list[tuple[str, torch.dtype, int, int]], int]:
    """Where each tensor's elements [a, b) sit in a chunk's slot: (key, dtype, byte offset, bytes)."""
    out, offset = [], 0
    for key, (dt, _) in meta.items():
        nbytes = (b - a) * dt.itemsize
        out.append((key, dt, offset, nbytes))
        offset += round_up(nbytes)
    return out, offset


def stream(store, group, kind: str, chunk: int, *, read_keys=None, write: bool = True
           ) -> Iterator[tuple[int, int, dict[str, torch.Tensor]]]:
    """Yield ``(a, b, views)`` for consecutive chunks [a, b) of the set, ``views[key]`` the
    chunk of each tensor in a staging slot: read before it is yielded (only ``read_keys``,
    None: all), written back after the caller is done with it (``write``). The next chunk's
    read is in flight while the caller works; write-backs finish on the store's finisher
    (``store.wait_writes`` waits for them). A key registered meanwhile is in the views of
    the chunks read after that. At most three slots of this stream are held at a time: the
    chunk the caller has, the next one's read and the previous one's write-back (the read
    after that waits for it), so a stream never takes the whole pool."""
    key = (id(group), kind)
    s = store._sets[key]
    store._check_healthy()
    meta = store._meta[key]
    numel = next(iter(meta.values()))[1]
    ranges = [(a, min(a + chunk, numel)) for a in range(0, numel, chunk)]
    file = store.file

    def start_read(a: int, b: int):
        layout, total = _layout(meta, a, b)
        slot = store.pool.acquire(total)
        try:
            futures = []
            for k, dt, off, n in layout:
                if read_keys is None or k in read_keys:
                    futures.extend(file.submit(False, f"{s.name}:{k}", slot[off:off + round_up(n)],
                                               start=a * dt.itemsize))
        except BaseException:
            store.pool.release(slot)
            raise
        return slot, layout, futures

    pending = None
    current = None
    last_write = None
    try:
        pending = start_read(*ranges[0])
        for i, (a, b) in enumerate(ranges):
            current, pending = pending, None
            slot, layout, futures = current
            wait_all(futures, file.path)
            if last_write is not None:
                last_write.result()  # its slot is free again (raises what the write raised)
                last_write = None
            if i + 1 < len(ranges):
                pending = start_read(*ranges[i + 1])
            yield a, b, {k: slot[off:off + n].view(dt) for k, dt, off, n in layout}
            current = None
            if not write:
                store.pool.release(slot)
                continue
            out = [f for k, dt, off, n in layout
                   for f in file.submit(True, f"{s.name}:{k}", slot[off:off + round_up(n)], start=a * dt.itemsize)]
            last_write = store._finisher.submit(_finish_write, store, slot, out)
            store._pending_out.append(last_write)
    except Exception as e:  # not GeneratorExit: a caller that stops early closes the stream
        store._fail(e)
        raise
    finally:
        for held in (current, pending):
            if held is not None:
                try:
                    wait_all(held[2], file.path)
                finally:
                    store.pool.release(held[0])


def _finish_write(store, slot: torch.Tensor, futures) -> None:
    try:
        wait_all(futures, store.file.path)
    except BaseException as e:
        store._fail(e)  # the file no longer holds this state: refuse to read it back
        raise
    finally:
        store.pool.release(slot)


def pieces(store, group, kind: str, key: str) -> Iterator[torch.Tensor]:
    """Tensor ``key`` of the set, piece after piece in a staging slot, read only: a piece is
    valid until the next one is asked for, so a caller writes it out (a checkpoint file)
    without the whole tensor ever in memory. Chunks are sized for the whole set's layout in a
    slot, as the step's are."""
    meta = store._meta[(id(group), kind)]
    chunk = chunk_elems(store.pool.slot_bytes, sum(dt.itemsize for dt, _ in meta.values()), meta[key][1])
    for _, _, views in stream(store, group, kind, chunk, read_keys={key}, write=False):
        yield views[key]


def write_from(store, group, kind: str, key: str, src: torch.Tensor, start: int = 0) -> None:
    """Elements [start, start + src.numel()) of tensor ``key`` <- src (cast), chunk by chunk
    through the slots; ``start`` a multiple of ``ALIGN_ELEMS``. Returns once every write is
    queued; ``store.wait_writes`` waits for them."""
    assert start % ALIGN_ELEMS == 0, start
    s = store._sets[(id(group), kind)]
    store._check_healthy()
    dt = store._meta[(id(group), kind)][key][0]
    chunk = chunk_elems(store.pool.slot_bytes, dt.itemsize, src.numel())
    src = src.reshape(-1)
    last_write = None
    try:
        for a in range(0, src.numel(), chunk):
            if last_write is not None:  # at most two slots: the one filled now, the one being written
                last_write.result()
            part = src[a:a + chunk]
            nbytes = part.numel() * dt.itemsize
            slot = store.pool.acquire(round_up(nbytes))
            try:
                slot[:nbytes].view(dt).copy_(part)
                out = store.file.submit(True, f"{s.name}:{key}", slot[:round_up(nbytes)],
                                        start=(start + a) * dt.itemsize)
            except BaseException:
                store.pool.release(slot)
                raise
            last_write = store._finisher.submit(_finish_write, store, slot, out)
            store._pending_out.append(last_write)
    except BaseException as e:
        store._fail(e)
        raise


def read_parts(store, group, kind: str, parts: list[tuple[str, int, int]]
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Read elements [a, b) of each tensor ``key`` of the set, ``parts`` (key, a, b) with ``a`` a
    multiple of ``ALIGN_ELEMS`` (or 0), into one buffer: a slot where they fit, else one of their
    size (``SlotPool.acquire_private``). Returns the buffer (``store.pool.release`` it) and the
    1-D views of each part in it; waits for the reads. A run of an owned group's step
    (See [Note: the ownership layout on NVMe] in _optim/owned_runs.py)."""
    s, meta = store._sets[(id(group), kind)], store._meta[(id(group), kind)]
    store._check_healthy()
    layout, total = [], 0
    for key, a, b in parts:
        dt = meta[key][0]
        assert a % ALIGN_ELEMS == 0 and b <= meta[key][1], (key, a, b)
        layout.append((key, dt, a, total, (b - a) * dt.itemsize))
        total += round_up((b - a) * dt.itemsize)
    buf = store.pool.acquire(total) if store.pool.fits(total) else store.pool.acquire_private(total)
    try:
        futures = [f for key, dt, a, off, n in layout
                   for f in store.file.submit(False, f"{s.name}:{key}", buf[off:off + round_up(n)],
                                              start=a * dt.itemsize)]
        wait_all(futures, store.file.path)
    except BaseException as e:
        store.pool.release(buf)
        store._fail(e)
        raise
    return buf, {key: buf[off:off + n].view(dt) for key, dt, a, off, n in layout}


def write_parts(store, group, kind: str, buf: torch.Tensor, parts: list[tuple[str, int, int]]) -> None:
    """Write back what ``read_parts`` read into ``buf`` for the same ``parts``; waits for the writes."""
    s, meta = store._sets[(id(group), kind)], store._meta[(id(group), kind)]
    futures, off = [], 0
    for key, a, b in parts:
        dt = meta[key][0]
        size = round_up((b - a) * dt.itemsize)
        futures.extend(store.file.submit(True, f"{s.name}:{key}", buf[off:off + size], start=a * dt.itemsize))
        off += size
    try:
        wait_all(futures, store.file.path)
    except BaseException as e:
        store._fail(e)  # the file no longer holds this state: refuse to read it back
        raise


def register(store, group, kind: str, key: str, tensor: torch.Tensor, numel: int) -> None:
    """A tensor of ``numel`` elements joins the set, evicted, its values to be written by
    chunks (``write_from`` or a stream's views): the optimizer state a streamed first step
    creates one chunk at a time. ``tensor`` is the object that views it when the set is
    brought in whole; registering the key again only swaps that object."""
    s = store._set(group, kind)
    meta = store._meta[(id(group), kind)]
    if key not in meta:
        store.file.region(f"{s.name}:{key}", numel * tensor.element_size())
        meta[key] = (tensor.dtype, numel)
    s.tensors[key] = tensor
