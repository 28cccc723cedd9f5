"""Train the TinyLM with torch DDP (the reference) and with zero_strategy on the same data.

args["cases"]: list of dicts with stage, precision, accum, no_sync, clip, steps,
persistence (param_persistence_threshold), optimizer ("adamw"|"sgd"), layers.
Reports per case: per-step losses of both, and the largest relative difference of
the final full weights (per tensor: max|a-b| / max|ref|). The DDP run is made once per launch
for all the cases it is the same for (:func:`reference_run`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import sys
import threading
import traceback

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from _worker import finish, start, worst_rel_diff
from _models import TinyLM, batch, loss_fn, param_groups

import zero_strategy as zs

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def make_optimizer(kind: str, params):
    if kind == "sgd":
        return torch.optim.SGD(params, momentum=0.9)
    return torch.optim.AdamW(params, betas=(0.9, 0.95))


def _offload(value, case):
    """"nvme" in a case means NVMe offload under the case's nvme_path (a per-test temp dir)."""
    if value == "nvme":
        return {"device": "nvme", "path": case["nvme_path"], "buffer_size": 4096 * 4}
    return value


class Reference:
    """torch DDP; for bf16/fp16 the textbook mixed-precision recipe around it.

    fp32: DDP over an fp32 copy, torch.optim on its parameters.
    bf16/fp16: DDP over a low-precision copy (forward/backward and the gradient
    all-reduce in that dtype), gradients copied to an fp32 master copy (divided by
    a static loss scale for fp16), torch.optim steps the masters, masters are cast
    back. Independent of zero_strategy's code; only the recipe is shared.
    """

    def __init__(self, base, case):
        self.dtype = DTYPES.get(case["precision"], torch.float32)
        self.master = copy.deepcopy(base)
        self.compute = copy.deepcopy(base).to(self.dtype) if self.dtype != torch.float32 else self.master
        self.ddp = DDP(self.compute)
        self.opt = make_optimizer(case.get("optimizer", "adamw"), param_groups(self.master))
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: 1.0 / (1 + s))
        self.scale = 2.0 ** 16 if case["precision"] == "fp16" else 1.0
        self.skipped = 0

    def micro_step(self, tokens, targets, accum, last):
        with (contextlib.nullcontext() if last else self.ddp.no_sync()):
            loss = loss_fn(self.ddp(tokens), targets) / accum
            (loss.float() * self.scale).backward()
        return loss.item()

    def step(self, clip, norm_type=2.0, zero_grad=True):
        norm = None
        if self.compute is not self.master:
            for pm, pc in zip(self.master.parameters(), self.compute.parameters()):
                if pc.grad is not None:
                    g = pc.grad.float() / self.scale
                    pm.grad = g if pm.grad is None else pm.grad + g
                    pc.grad = None
        if self.scale != 1.0:  # dynamic loss scaling as torch.amp.GradScaler does it
            grads = [p.grad for p in self.master.parameters() if p.grad is not None]
            if not all(torch.isfinite(g).all() for g in grads):
                self.skipped += 1
                self.scale *= 0.5
                self.opt.zero_grad()
                self.sched.step()
                return float("inf") if clip else None
        if clip:
            norm = torch.nn.utils.clip_grad_norm_(self.master.parameters(), clip, norm_type).item()
        self.opt.step()
        if zero_grad:
            self.opt.zero_grad()
        self.sched.step()
        if self.compute is not self.master:
            with torch.no_grad():
                for pm, pc in zip(self.master.parameters(), self.compute.parameters()):
                    pc.copy_(pm)
        return norm

    def full_state_dict(self):
        """Trainable tensors from the masters; frozen ones as the compute copy holds them."""
        sd = self.master.state_dict()
        frozen = {n for n, p in self.master.named_parameters() if not p.requires_grad}
        for name, t in self.compute.state_dict().items():
            if name in frozen:
                sd[name] = t.float()
        return sd


class _DeferredHandle:
    """Runs the collective only when waited on: a missing wait leaves garbage, visibly."""

    def __init__(self, run):
        self._run = run

    def wait(self):
        if self._run is not None:
            self._run()
            self._run = None


def _poison_except(out, inp):
    """NaN-fill ``out`` except where it holds the input (in-place all-gather)."""
    if out.untyped_storage().data_ptr() != inp.untyped_storage().data_ptr():
        out.fill_(float("nan"))
        return
    start = (inp.data_ptr() - out.data_ptr()) // out.element_size()
    out[:start].fill_(float("nan"))
    out[start + inp.numel():].fill_(float("nan"))


def _poison(t):
    if t.is_floating_point():
        t.fill_(float("nan"))


def _overlaps(a, b) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _inside(inner, outer) -> bool:
    """``inner`` is a view within ``outer`` (an all-gather's own slot)."""
    start = inner.data_ptr() - outer.data_ptr()
    return _overlaps(inner, outer) and 0 <= start and start + inner.numel() * inner.element_size() <= (
        outer.numel() * outer.element_size())


def _changed(now, then) -> bool:
    """``now`` differs from its copy ``then`` (NaN equal to NaN)."""
    both_nan = now.isnan() & then.isnan() if now.is_floating_point() else torch.zeros_like(now, dtype=torch.bool)
    return bool(((now != then) & ~both_nan).any())


class _DeferredCopy:
    """A host<->device copy that happens only when its event is waited for: the object
    ``Transfers.download/upload`` return (``synchronize()``: the host waits; ``wait(stream)``:
    a stream is ordered after it). ``on_stream_wait``: whether ``wait(stream)`` makes the data
    usable (an upload read by device work); a download is read by the host, which must
    ``synchronize()``."""

    def __init__(self, run, on_stream_wait: bool):
        self._run, self._on_stream_wait = run, on_stream_wait
        self._lock = threading.Lock()

    def _go(self):
        with self._lock:
            if self._run is not None:
                run, self._run = self._run, None
                run()

    def synchronize(self):
        self._go()

    def wait(self, stream=None):
        if self._on_stream_wait:
            self._go()


class _DeferredFuture(concurrent.futures.Future):
    """A job that runs only when its result is asked for (or ``concurrent.futures.wait``ed on)."""

    def __init__(self, run):
        super().__init__()
        self._job = run
        self._job_lock = threading.Lock()

    def run_now(self):
        with self._job_lock:
            if self._job is None:
                return
            job, self._job = self._job, None
            try:
                self.set_result(job())
            except BaseException as e:  # noqa: BLE001 - delivered by result(), as a pool would
                self.set_exception(e)

    def result(self, timeout=None):
        self.run_now()
        return super().result(timeout)


class _DeferredExecutor:
    """``submit`` returns a :class:`_DeferredFuture`; ``job(fn, args)``, called at submission,
    returns what that future runs (default: ``fn(*args)``)."""

    def __init__(self, inner=None, job=None):
        self._inner, self._job = inner, job

    def submit(self, fn, *args, **kwargs):
        run = self._job(fn, args) if self._job is not None else (lambda: fn(*args, **kwargs))
        return _DeferredFuture(run)

    def shutdown(self, wait=True, cancel_futures=False):
        if self._inner is not None:
            self._inner.shutdown(wait=wait, cancel_futures=cancel_futures)


@contextlib.contextmanager
def _patched(obj, name, value):
    original = obj.__dict__[name] if isinstance(obj, type) else getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, original)


@contextlib.contextmanager
def deferred_collectives(enabled: bool):
    """Every asynchronous operation of the engine takes effect only at its wait:

    * async ``Collectives.all_gather`` / ``reduce_scatter``: the output is NaN until ``wait()``;
    * offload copies, ``Transfers.download`` / ``upload`` (and so ``upload_cast``, which
      uploads from a staging slot): the destination is NaN until the event is waited for;
    * the CPU worker (``Transfers.pool``: the offloaded step, overlap_step's steps started
      in backward): a job runs only when its future's ``result()`` (or
      ``concurrent.futures.wait``) is asked for;
    * NVMe I/O (``SwapFile``'s I/O pool): a read leaves its slot 0xFF bytes (NaN) until its
      future is waited on.

    Inputs are read at launch (a collective's, an upload's source, a write's slot): one
    written between launch and wait is a race too, and sends NaN (0xFF bytes).

    So a result read before its wait, or a wait that never comes, is NaN or stale data,
    deterministically, and the run no longer matches DDP. (``all_reduce_replicas``, hybrid
    sharding's cross-group all-reduce, is synchronous: its input is the reduce-scatter's
    output, which this defers.)
    """
    if not enabled:
        yield
        return
    from zero_strategy._comm.collectives import Collectives
    from zero_strategy._mechanisms.aligned import aligned_empty
    from zero_strategy._mechanisms.nvme import SwapFile
    from zero_strategy._mechanisms.transfers import Transfers

    def wrap(original):
        def deferred(self, out, inp, async_op=True, **kw):  # kw: the collective's label
            if not async_op:
                return original(self, out, inp, async_op=False, **kw)
            # what is sent is read at launch (the output appears at the wait): an input written
            # after the launch sends NaN. A reduce-scatter into its own input (stage 1) is not checked.
            checked = not _overlaps(out, inp) or _inside(inp, out)
            sent = inp.clone()
            _poison_except(out, inp)

            def run():
                if checked and _changed(inp, sent):
                    _poison(inp)
                    _poison(sent)
                original(self, out, inp if _inside(inp, out) else sent, async_op=False, **kw)
            return _DeferredHandle(run)
        return deferred

    def download(self, dst_host, src_dev):
        _poison(dst_host)
        return _DeferredCopy(lambda: dst_host.copy_(src_dev), on_stream_wait=False)

    def upload(self, dst_dev, src_host):
        sent = src_host.clone()  # read at launch too: a source written before the wait uploads NaN
        _poison(dst_dev)

        def run():
            if _changed(src_host, sent):
                _poison(sent)
            dst_dev.copy_(sent)
        return _DeferredCopy(run, on_stream_wait=True)

    def pool(self):
        if self._pool is None:
            self._pool = _DeferredExecutor()
        return self._pool

    def swap_io(fn, args):
        """A read fills its slot (0xFF bytes until then) at the wait; a write sends what its
        slot held at submission, or 0xFF bytes if the slot changed before the wait."""
        write, part, offset = args
        if not write:
            part.fill_(255)
            return lambda: fn(write, part, offset)
        sent = aligned_empty(part.numel(), pin=False)  # O_DIRECT wants aligned buffers
        sent.copy_(part)

        def run():
            if _changed(part, sent):
                sent.fill_(255)
            return fn(write, sent, offset)
        return run

    swap_file_init = SwapFile.__init__

    def init_swap_file(self, *args, **kwargs):
        swap_file_init(self, *args, **kwargs)
        self._io = _DeferredExecutor(self._io, job=swap_io)

    futures_wait = concurrent.futures.wait

    def wait(fs, *args, **kwargs):
        for f in fs:
            if isinstance(f, _DeferredFuture):
                f.run_now()
        return futures_wait(fs, *args, **kwargs)

    with contextlib.ExitStack() as stack:
        for name in ("all_gather", "reduce_scatter"):
            stack.enter_context(_patched(Collectives, name, wrap(getattr(Collectives, name))))
        stack.enter_context(_patched(Transfers, "download", download))
        stack.enter_context(_patched(Transfers, "upload", upload))
        stack.enter_context(_patched(Transfers, "pool", property(pool)))
        stack.enter_context(_patched(SwapFile, "__init__", init_swap_file))
        stack.enter_context(_patched(concurrent.futures, "wait", wait))
        yield


def run_case(case: dict) -> dict:
    with deferred_collectives(case.get("defer", False)):
        return _run_case(case)


#: the case's keys that only the zero_strategy side reads: cases that differ only in these (the
#: stages of one precision and accumulation, the offload policies, ...) have the same reference
ZERO_ONLY = frozenset({"stage", "persistence", "reduce_dtype", "clip_in_config", "offload_optimizer",
                       "offload_params", "overlap_step", "shard_group_size", "nvme_path", "no_sync", "defer"})
_REFERENCES: dict[str, dict] = {}


def reference_run(case: dict) -> dict:
    """DDP's run of ``case`` (:class:`Reference` from ``torch.manual_seed(1234)``'s TinyLM on this
    rank's batches), once per launch for all the cases that share it: the reference reads none of
    :data:`ZERO_ONLY`, and it is deterministic, so running it again for the next stage gave the same
    losses and weights bit for bit. Every rank runs the same cases in the same order, so the ranks
    agree on which reference runs (DDP's all-reduces stay in lock-step)."""
    key = repr(sorted((k, repr(v)) for k, v in case.items() if k not in ZERO_ONLY))
    if key not in _REFERENCES:
        _REFERENCES[key] = _train_reference(case)
    return _REFERENCES[key]


def _train_reference(case: dict) -> dict:
    rank = dist.get_rank()
    torch.manual_seed(1234)
    ref = Reference(TinyLM(layers=case.get("layers", 3)), case)
    accum, clip = case["accum"], case.get("clip")
    losses, norms = [], []
    for step in range(case.get("steps", 4)):
        total = 0.0
        for micro in range(accum):
            tokens, targets = batch(rank, step, micro)
            total += ref.micro_step(tokens, targets, accum, micro == accum - 1)
        zero_now = (step + 1) % case.get("zero_grad_every", 1) == 0  # else gradients carry over
        norms.append(ref.step(clip, float(case.get("clip_norm_type", 2.0)), zero_now))
        losses.append(total)
    return dict(losses=losses, norms=norms, skipped=ref.skipped, scale=ref.scale,
                state_dict={k: v.detach().clone() for k, v in ref.full_state_dict().items()})


def _run_case(case: dict) -> dict:
    rank = dist.get_rank()
    ref = reference_run(case)
    torch.manual_seed(1234)
    model = TinyLM(layers=case.get("layers", 3))
    opt = make_optimizer(case.get("optimizer", "adamw"), param_groups(model))
    cfg = zs.ZeroConfig(stage=case["stage"], precision=case["precision"],
                        param_persistence_threshold=case.get("persistence", 0),
                        reduce_dtype=case.get("reduce_dtype"),
                        gradient_clipping=case.get("clip") if case.get("clip_in_config") else None,
                        offload_optimizer=_offload(case.get("offload_optimizer"), case),
                        offload_params=_offload(case.get("offload_params"), case),
                        overlap_step=case.get("overlap_step", False),
                        shard_group_size=case.get("shard_group_size"))
    model, zopt = zs.setup(model, opt, cfg)
    sched = torch.optim.lr_scheduler.LambdaLR(zopt, lambda s: 1.0 / (1 + s))

    accum, clip = case["accum"], case.get("clip")
    losses_zero, norms_zero = [], []
    for step in range(case.get("steps", 4)):
        total_zero = 0.0
        for micro in range(accum):
            tokens, targets = batch(rank, step, micro)
            last = micro == accum - 1
            sync = contextlib.nullcontext() if last or not case.get("no_sync", True) else zs.no_sync(model)
            with sync:
                lz = loss_fn(model(tokens), targets) / accum
                zopt.backward(lz)
            total_zero += lz.item()
        norm_type = float(case.get("clip_norm_type", 2.0))
        zero_now = (step + 1) % case.get("zero_grad_every", 1) == 0  # else gradients carry over
        if clip and not case.get("clip_in_config"):
            norms_zero.append(zopt.clip_grad_norm_(clip, norm_type).item())
        zopt.step()
        if zero_now:
            zopt.zero_grad()
        sched.step()
        losses_zero.append(total_zero)
    norms_ref = ref["norms"] if clip and not case.get("clip_in_config") else []
    full = zs.full_state_dict(model)
    ref_sd = ref["state_dict"]
    if set(full) != set(ref_sd):
        raise AssertionError(f"state dict keys differ: {set(full) ^ set(ref_sd)}")
    worst, worst_name = worst_rel_diff(full, ref_sd)
    return dict(case=case, losses_ref=ref["losses"], losses_zero=losses_zero, norms_ref=norms_ref,
                norms_zero=norms_zero, skipped_ref=ref["skipped"], skipped_zero=zopt.skipped_steps,
                loss_scale_ref=ref["scale"], loss_scale_zero=zopt.loss_scale,
                steps_overlapped=zs.api._engine_of(model).steps_overlapped,
                trainable_groups=len(zs.api._engine_of(model).trainable_groups), weight_rel_diff=worst, worst_tensor=worst_name)


def main() -> None:
    args, out = start()
    results = []
    for case in args["cases"]:
        try:
            results.append(run_case(case))
        except Exception:  # report, keep the other cases running in lock-step
            results.append(dict(case=case, error=traceback.format_exc()))
            print(traceback.format_exc(), file=sys.stderr)
            break
    finish(out, {"results": results})


if __name__ == "__main__":
    main()
