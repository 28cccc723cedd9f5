"""Slices of parameters that a conversion builds from several checkpoint tensors, read in slices.

A Hugging Face checkpoint of a mixture-of-experts model holds one tensor per expert
(``experts.3.w1.weight``), and the model one fused tensor per layer
(``experts.gate_up_proj``, ``[experts, 2 * intermediate, hidden]``): the library's loader
stacks the experts and concatenates gate and up as it reads (its "weight converters").
Reading the fused tensor whole on every rank, to keep a slice of it, is what ZeRO exists to
avoid, so the conversion is run here on *where the values come from* instead of on the values.

[Note: conversions run on row ids]
A conversion that only rearranges (stack, concatenate, chunk, split, transpose,
interleave, permute) moves elements without computing new ones. Run it on tensors of
integer ids in place of the checkpoint tensors, and the result tells, for each element of
the parameter, which checkpoint element it is. Ids per element would cost twice the fp32
parameter, so the ids are per *row* (every dimension but the last): each source tensor
``[..., L]`` is given as ``[..., 1]`` holding its rows' ids. Where the conversion leaves the
last dimension alone (every expert merge in the library's mapping does), the result has the
parameter's shape with a last dimension of 1, and element ``p`` of the flattened parameter
is column ``p % L`` of the row whose id sits at ``p // L``. A rank then reads, source by
source, only the rows its slice covers (contiguous rows in one read), never a whole fused
tensor. A conversion that does touch the last dimension is run on ids per element instead
(one parameter at a time, while its slices are read). The ids must come back as integers,
each within range and none twice: a conversion that computes values (dequantization) fails
that test and is refused by name before anything is read.
"""

from __future__ import annotations

from typing import Callable

import torch

from ._layout import CheckpointError

#: convert({source pattern: [tensors, in the checkpoint's order]}) -> {parameter name: tensor}
Conversion = Callable[[dict[str, list[torch.Tensor]]], dict[str, torch.Tensor]]


class ConvertedGroup:
    """The parameters one conversion builds (``convert``) from the checkpoint tensors ``sources``
    ({source pattern: [checkpoint keys]}), read in slices through ``slice_of(key)`` (a safetensors
    slice: ``get_shape()``, ``get_dtype()``, ``[rows]``). See [Note: conversions run on row ids]."""

    def __init__(self, what: str, sources: dict[str, list[str]], convert: Conversion, slice_of, dtype_of):
        self.what, self.sources, self.convert, self.slice_of = what, sources, convert, slice_of
        self.keys = [k for keys in sources.values() for k in keys]
        self.shapes = {k: list(slice_of(k).get_shape()) for k in self.keys}
        self.dtype = dtype_of(slice_of(self.keys[0]).get_dtype())
        meta = self.convert({p: [torch.empty(self.shapes[k], dtype=self.dtype, device="meta") for k in keys]
                             for p, keys in sources.items()})
        self.targets = {name: tuple(t.shape) for name, t in meta.items()}  # parameter -> its shape
        self._rows = self._row_ids()  # None: the conversion touches the last dimension

    # ------------------------------------------------------------------ ids
    def _ids(self, per_row: bool) -> tuple[dict[str, torch.Tensor], list[int]]:
        """The conversion run on ids (See [Note: conversions run on row ids]); the id base of each key."""
        bases, inputs, n = [], {}, 0
        for p, keys in self.sources.items():
            inputs[p] = []
            for k in keys:
                shape = self.shapes[k][:-1] + [1] if per_row and self.shapes[k] else self.shapes[k]
                count = torch.Size(shape).numel()
                bases.append(n)
                inputs[p].append(torch.arange(n, n + count, dtype=torch.int64).reshape(shape))
                n += count
        try:
            out = self.convert(inputs)
        except Exception as err:  # noqa: BLE001 - a conversion that cannot run on ids is refused below
            raise _computes(self.what, f"{type(err).__name__}: {err}") from None
        if set(out) != set(self.targets) or any(t.dtype != torch.int64 for t in out.values()):
            dtypes = sorted({str(t.dtype) for t in out.values()})
            raise _computes(self.what, f"its result is not a rearrangement of the checkpoint's elements: the "
                                       f"elements' ids came back as {dtypes}")
        seen = torch.cat([t.reshape(-1) for t in out.values()])
        if seen.numel() and (seen.min() < 0 or seen.max() >= n or torch.unique(seen).numel() != seen.numel()):
            raise _computes(self.what, "its result repeats or invents elements")
        return out, bases

    def _row_ids(self) -> dict[str, torch.Tensor] | None:
        lasts = {s[-1] if s else None for s in self.shapes.values()}
        if len(lasts) != 1 or None in lasts:
            self._ids(per_row=False)  # checked now (refused before setup), computed again when read
            return None
        last = lasts.pop()
        try:
            out, _ = self._ids(per_row=True)
        except CheckpointError:
            out = None
        if out is None or any(tuple(out[n].shape) != shape[:-1] + (1,) or shape[-1] != last
                              for n, shape in self.targets.items()):
            self._ids(per_row=False)
            return None
        self.last = last
        return out

    # ---------------------------------------------------------------- reads
    def read(self, name: str, start: int, end: int) -> torch.Tensor:
        """Elements [start, end) of the flattened parameter ``name``, reading only the rows they come from."""
        if self._rows is not None:
            return self._read_rows(self._rows[name].reshape(-1), start, end)
        ids, bases = self._ids(per_row=False)  # one parameter's ids, only while its slices are read
        return self._read_elements(ids[name].reshape(-1)[start:end], bases)

    def _located(self, ids: torch.Tensor, sizes: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(which key, the id within that key) of each id; ``sizes``: each key's count of ids."""
        ends = torch.tensor(sizes, dtype=torch.int64).cumsum(0)
        which = torch.searchsorted(ends, ids, right=True)
        return which, ids - (ends - torch.tensor(sizes, dtype=torch.int64))[which]

    def _read_rows(self, row_ids: torch.Tensor, start: int, end: int) -> torch.Tensor:
        last = self.last
        first, stop = start // last, -(-end // last)
        rows = row_ids[first:stop]
        sizes = [torch.Size(self.shapes[k][:-1]).numel() for k in self.keys]
        which, local = self._located(rows, sizes)
        # runs of consecutive rows of one key: one read each
        breaks = torch.nonzero((which[1:] != which[:-1]) | (local[1:] != local[:-1] + 1)).reshape(-1) + 1
        bounds = [0, *breaks.tolist(), rows.numel()]
        pieces = []
        for a, b in zip(bounds[:-1], bounds[1:]):
            key = self.keys[int(which[a])]
            pieces.append(self._rows_of(key, int(local[a]), int(local[a]) + (b - a)))
        values = torch.cat(pieces) if len(pieces) != 1 else pieces[0]
        return values.reshape(-1)[start - first * last:end - first * last]

    def _rows_of(self, key: str, lo: int, hi: int) -> torch.Tensor:
        """Rows [lo, hi) (every dimension but the last flattened) of ``key``, reading whole rows of its
        leading dimension only."""
        shape = self.shapes[key]
        per_lead = torch.Size(shape[1:-1]).numel() if len(shape) > 1 else 1
        a, b = lo // per_lead, -(-hi // per_lead)
        sl = self.slice_of(key)
        values = sl[a:b] if len(shape) > 1 else sl[...]
        return values.reshape(-1, shape[-1])[lo - a * per_lead:hi - a * per_lead]

    def _read_elements(self, ids: torch.Tensor, bases: list[int]) -> torch.Tensor:
        sizes = [torch.Size(self.shapes[k]).numel() for k in self.keys]
        which, local = self._located(ids, sizes)
        out = torch.empty(ids.numel(), dtype=self.dtype)
        for i in torch.unique(which).tolist():
            mask = which == i
            mine = local[mask]
            key = self.keys[i]
            shape = self.shapes[key]
            row = torch.Size(shape[1:]).numel() if len(shape) > 1 else 1
            a, b = int(mine.min()) // row, int(mine.max()) // row + 1
            sl = self.slice_of(key)
            values = (sl[a:b] if len(shape) > 1 else sl[...]).reshape(-1)
            out[mask] = values[mine - a * row]
        return out


def _computes(what: str, why: str) -> CheckpointError:
    return CheckpointError(
        f"{what}: this conversion cannot be read in slices ({why}): it computes new values (or casts) "
        "rather than only rearranging the checkpoint's. Load with transformers' from_pretrained and then zero_strategy.setup, "
        "or save the converted model once with save_pretrained and load that directory")
