"""The tiled causal-LM loss: the head and the cross-entropy chunk by chunk, recomputed in backward.

[Note: the tiled loss]
A causal LM's loss starts from logits of shape (tokens, vocab): at 4,096 tokens and a 32,000-token
vocabulary that is 0.5 GiB in fp32 per copy, and the usual path makes several (the head's output,
its fp32 upcast, the log-softmax autograd keeps, the gradient of each in backward). Model states
sharded by ZeRO are then smaller than this one activation. :class:`TiledCrossEntropy` never holds
it: forward computes ``head(hidden[i:j]).float()`` for one chunk of tokens at a time and keeps only
the sum of its cross-entropy; it saves for backward the hidden states, the head's weight (and bias)
and the labels, all of which exist anyway. Backward recomputes each chunk's logits and turns them
into their own gradient, ``scale * (softmax - onehot(label))`` on the rows with a label, in place,
then multiplies it into the gradients of the hidden states and of the head, in the dtype the head
computed in (the logits' before the upcast), as autograd's backward of the untiled path does. The
result is the untiled loss's to rounding (the softmax is ``exp(x - max) / sum``, as
``log_softmax`` computes it; bf16: the head's gradient is summed over chunks in fp32).

One chunk of fp32 logits is the only (chunk x vocab) tensor alive in fp32 models, in forward and in
backward: the log-sum-exp is taken in place (``x - max``, ``exp``, a row sum), the gradient is
written over the softmax, and the chunk is freed before the next is made. Below fp32 the upcast and
its source, and later the fp32 gradient and its cast back, are alive together for a moment:
(4 + e) bytes a logit. Autograd's version of the same chunk keeps four fp32 copies (the logits,
the log-softmax, its gradient, the logits' gradient), DeepSpeed's ``TiledFusedLogitsLoss``, which
runs autograd on each shard, up to three (the logits are freed once the log-softmax is made).

The chunk (:func:`default_chunk_tokens`) is an eighth of the tokens the call is given, at most
the tokens whose fp32 logits take :data:`DEFAULT_CHUNK_BYTES`. A fixed number of chunks, not only a
byte budget, because under sequence parallelism a rank is given 1/N of the sequence and its loss
must then hold 1/N of the memory too: with a chunk of a fixed number of tokens a rank cuts its
shard in fewer chunks, but the peak is one chunk, the same at every degree (issue 40 measured 0.94x
of sp 1's peak at sp 2 with a fixed 64 MiB chunk). Past 8 x the budget's tokens the chunk stays
at the budget, a constant beside activations that grow with the tokens.

The reduction follows transformers' ``ForCausalLMLoss``: the mean over tokens whose label is not
``ignore_index``, or the sum divided by ``num_items_in_batch`` when that is given (gradient
accumulation and the Trainer pass it). One difference, on purpose: a batch with no valid token
(a sequence-parallel shard of prompt tokens masked with -100) gives a loss of 0 and zero
gradients, where ``F.cross_entropy(reduction="mean")`` gives NaN, which one such shard would
spread to every rank through the gradient reduction.

[Note: the head runs as a module]
At stage 3 the head's weight is a parameter the engine gathers in a forward pre-hook of the
head (or of the root unit holding it) and releases in its post-hook; read outside that
forward it may be an empty placeholder. So :func:`head_loss` calls the head module itself, with
its ``forward`` shadowed for that one call by the tiled loss: the engine's hooks fire around it,
the weight is gathered while the chunks are computed, and the hook the engine puts on the
module's output (here the loss) gathers it again before the recomputation in backward.
"""

from __future__ import annotations

import contextlib
import inspect
import re
import weakref
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

#: the fp32 logits of one chunk take at most about this many bytes when no chunk size is given
DEFAULT_CHUNK_BYTES = 64 * 2**20
#: ... and the tokens of one call are cut in at least this many chunks
DEFAULT_CHUNKS = 8
IGNORE_INDEX = -100


def default_chunk_tokens(vocab_size: int, tokens: int) -> int:
    """Tokens per chunk of a call given ``tokens``: a :data:`DEFAULT_CHUNKS` th of them, at most as many
    as fp32 logits of :data:`DEFAULT_CHUNK_BYTES` hold. See [Note: the tiled loss]."""
    budget = max(1, DEFAULT_CHUNK_BYTES // (4 * max(1, vocab_size)))
    return max(1, min(budget, -(-tokens // DEFAULT_CHUNKS)))


def shifted(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """transformers' shift: position t predicts label t + 1, the last position predicts nothing.
    (batch, seq) -> (batch, seq)."""
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:]


class TiledCrossEntropy(torch.autograd.Function):
    """``sum(cross_entropy(head(hidden).float(), labels)) / denominator`` one chunk of tokens at a time.

    See [Note: the tiled loss]. hidden: (n, h); weight: (V, h); bias: (V,) or None; labels: (n,).
    """

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                labels: torch.Tensor, denominator: torch.Tensor, chunk: int, ignore_index: int) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        ctx.compute_dtype = weight.dtype  # the head's output dtype (under autocast, autocast's)
        for start in range(0, hidden.shape[0], chunk):
            logits = F.linear(hidden[start:start + chunk], weight, bias)  # (chunk, V)
            ctx.compute_dtype = logits.dtype
            logits = logits.float()  # below fp32 the source is freed here
            valid, target = _targets(labels[start:start + chunk], ignore_index)
            picked = logits.gather(1, target[:, None]).squeeze(1)
            top, sums = _exp_shifted_(logits)  # logits are spent: they hold exp(x - max) now
            total += torch.where(valid, top + sums.log() - picked, 0.0).sum()
            del logits
        ctx.save_for_backward(hidden, weight, bias, labels, denominator)
        ctx.chunk, ctx.ignore_index = chunk, ignore_index
        return total / denominator

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        hidden, weight, bias, labels, denominator = ctx.saved_tensors
        needs_hidden, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        scale = (grad_loss / denominator).to(torch.float32)
        dtype = ctx.compute_dtype
        grad_hidden = torch.empty_like(hidden) if needs_hidden else None
        # the head's gradient is summed over chunks in fp32, then cast to the weight's dtype
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if needs_weight else None
        grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if needs_bias else None
        with _no_autocast(hidden.device.type):  # the forward's autocast is replayed by casting to ``dtype``
            w = weight.detach().to(dtype)
            b = None if bias is None else bias.detach().to(dtype)
            for start in range(0, hidden.shape[0], ctx.chunk):
                h = hidden[start:start + ctx.chunk].detach().to(dtype)
                grad_logits = _logits_gradient_(F.linear(h, w, b).float(), labels[start:start + ctx.chunk],
                                                ctx.ignore_index, scale).to(dtype)  # (chunk, V)
                if needs_hidden:
                    grad_hidden[start:start + ctx.chunk] = grad_logits @ w
                if needs_weight:
                    if dtype == torch.float32:
                        grad_weight.addmm_(grad_logits.T, h)
                    else:
                        grad_weight += grad_logits.T @ h
                if needs_bias:
                    grad_bias += grad_logits.sum(0)
                del grad_logits
        grad_weight = None if grad_weight is None else grad_weight.to(weight.dtype)
        grad_bias = None if grad_bias is None else grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None


def _targets(labels: torch.Tensor, ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows with a label, the label or 0 where there is none): indices ``gather`` can take."""
    valid = labels != ignore_index
    return valid, torch.where(valid, labels, 0)


def _exp_shifted_(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's max and ``sum(exp(x - max))`` (n,), as ``log_softmax`` computes them, with ``logits``
    itself left holding ``exp(x - max)``: no second (n, V) tensor."""
    top = logits.amax(dim=1, keepdim=True)
    return top.squeeze(1), logits.sub_(top).exp_().sum(dim=1)


def _logits_gradient_(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int,
                      scale: torch.Tensor) -> torch.Tensor:
    """The gradient of ``scale * sum(cross_entropy(logits, labels))`` written over ``logits`` (fp32):
    ``scale * (softmax - onehot(label))`` on rows with a label, 0 elsewhere."""
    valid, target = _targets(labels, ignore_index)
    _, sums = _exp_shifted_(logits)
    weights = torch.where(valid, scale, 0.0)  # (n,)
    logits.mul_((weights / sums)[:, None])
    return logits.scatter_add_(1, target[:, None], -weights[:, None])


def _no_autocast(device_type: str):
    """Backward casts by itself; an autocast around ``loss.backward()`` must not recast it."""
    if not torch.amp.is_autocast_available(device_type):
        return contextlib.nullcontext()
    return torch.autocast(device_type, enabled=False)


def tiled_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        shift_labels: torch.Tensor, *, num_items_in_batch: int | torch.Tensor | None = None,
                        ignore_index: int = IGNORE_INDEX, chunk_tokens: int | None = None) -> torch.Tensor:
    """The causal-LM loss of ``hidden`` (..., h) under the head ``weight`` (V, h) and ``bias``, against
    ``shift_labels`` (...) already shifted, without the logits ever held whole. See [Note: the tiled loss].

    Reads ``weight`` as given: at stage 3 call it inside the head's forward (:func:`head_loss` does).
    """
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    labels = shift_labels.reshape(-1).to(flat_hidden.device)
    if labels.shape[0] != flat_hidden.shape[0]:
        raise ValueError(f"zero_strategy: the tiled loss got {flat_hidden.shape[0]} hidden states and "
                         f"{labels.shape[0]} labels; pass labels of the hidden states' (batch, sequence) shape.")
    if num_items_in_batch is None:  # the mean over valid tokens; none valid: 0, not NaN
        denominator = (labels != ignore_index).sum().clamp(min=1).to(torch.float32)
    else:
        denominator = torch.as_tensor(num_items_in_batch, dtype=torch.float32, device=flat_hidden.device)
    chunk = chunk_tokens or default_chunk_tokens(weight.shape[0], flat_hidden.shape[0])
    return TiledCrossEntropy.apply(flat_hidden, weight, bias, labels, denominator, int(chunk), ignore_index)


def check_head(head: nn.Module, what: str) -> None:
    """The tiled loss computes ``hidden @ weight.T + bias``: a plain ``nn.Linear`` head only."""
    if type(head) is not nn.Linear:
        raise ValueError(
            f"zero_strategy: the tiled loss computes the head as a plain nn.Linear, but {what} is "
            f"{type(head).__name__} (a LoRA-wrapped, quantized or custom head). Leave the head out of LoRA "
            "targets and quantization, or turn tiled_loss off.")


def head_loss(head: nn.Linear, hidden: torch.Tensor, shift_labels: torch.Tensor, *,
              num_items_in_batch: int | torch.Tensor | None = None, ignore_index: int = IGNORE_INDEX,
              chunk_tokens: int | None = None) -> torch.Tensor:
    """Call ``head(hidden)`` with its forward computing the tiled loss instead of the logits, so hooks on
    the head (the engine's stage-3 gather and release) run around it. See [Note: the head runs as a module]."""
    check_head(head, "the head")

    def forward(h: torch.Tensor) -> torch.Tensor:
        return tiled_cross_entropy(h, head.weight, head.bias, shift_labels, num_items_in_batch=num_items_in_batch,
                                   ignore_index=ignore_index, chunk_tokens=chunk_tokens)

    with _forward_replaced(head, forward):
        return head(hidden)


@contextlib.contextmanager
def _forward_replaced(module: nn.Module, forward: Callable):
    """``module.forward`` is ``forward`` inside the block (an instance attribute, as before it after)."""
    missing = object()
    before = module.__dict__.get("forward", missing)
    module.__dict__["forward"] = forward
    try:
        yield
    finally:
        if before is missing:
            module.__dict__.pop("forward", None)
        else:
            module.__dict__["forward"] = before


def tiled_causal_lm_loss(head: nn.Linear, hidden_states: torch.Tensor, labels: torch.Tensor | None = None, *,
                         shift_labels: torch.Tensor | None = None,
                         num_items_in_batch: int | torch.Tensor | None = None,
                         ignore_index: int = IGNORE_INDEX, chunk_tokens: int | None = None) -> torch.Tensor:
    """The loss ``F.cross_entropy(head(hidden_states).float(), labels shifted)`` of a causal LM, computed
    chunk by chunk so the (tokens x vocab) logits never exist whole, for a model of your own.

    ``hidden_states``: (batch, seq, hidden), the input of ``head``. ``labels`` (batch, seq) are shifted
    as transformers shifts them (position t predicts t + 1); ``shift_labels`` are taken as already
    shifted (a sequence-parallel shard's). The mean over tokens whose label is not ``ignore_index`` (0
    when there is none), or the sum over ``num_items_in_batch``. Works at every stage: ``head`` runs as
    a module, so a stage-3 head is gathered around it. See [Note: the tiled loss].
    """
    if (labels is None) == (shift_labels is None):
        raise ValueError("zero_strategy: tiled_causal_lm_loss needs exactly one of labels= (shifted here) or "
                         "shift_labels= (already shifted).")
    if shift_labels is None:
        shift_labels = shifted(labels, ignore_index)
    return head_loss(head, hidden_states, shift_labels, num_items_in_batch=num_items_in_batch,
                     ignore_index=ignore_index, chunk_tokens=chunk_tokens)


# ----------------------------------------------------------- a transformers causal LM's own loss
#
# [Note: the tiled loss in a Hugging Face model]
# ``ZeroConfig(tiled_loss=...)`` shadows ``forward`` of each transformers ``*ForCausalLM`` in the
# model (_model/hf.py finds them; _model/install.py puts the shadow on and teardown takes it off),
# so ``model(input_ids, labels=labels).loss`` and the Trainer's ``compute_loss`` take the tiled
# path with no change to the loop. When the call is in training mode and carries ``labels`` or
# ``shift_labels`` (and ``logits_to_keep`` is left at 0), the model's own forward runs without
# them, with the head's forward replaced for that call by the tiled loss (See [Note: the head
# runs as a module]); the output carries that loss and ``logits=None``, as Liger's fused loss
# does. Eval mode, a call without labels and ``logits_to_keep`` take the model's path unchanged
# (``generate`` and evaluation see real logits). ``num_items_in_batch``, ``ignore_index`` and
# ``shift_labels`` keep the meaning ``ForCausalLMLoss`` gives them. A model that changes its logits
# after the head (Gemma's soft-capping, Cohere's ``logit_scale``, Granite's ``logits_scaling``) or
# computes its loss with another function is refused at setup by :func:`refuse_untileable`.

#: config attributes that make a model transform its logits after the head, and the value that does not
_LOGIT_TRANSFORMS = {"final_logit_softcapping": None, "logit_scale": None, "logits_scaling": 1.0,
                     "output_multiplier_scale": None, "logit_softcapping": None}
_ASSIGNS_LOGITS = re.compile(r"^\s*logits\s*(=|\*=|/=|\+=|-=)")


def refuse_untileable(module: nn.Module) -> None:
    """Raise, naming the model and the reason, when the tiled loss would not give ``module``'s own loss."""
    name = type(module).__name__
    head = module.get_output_embeddings()
    if head is None or getattr(module, "lm_head", None) is not head:
        raise ValueError(f"zero_strategy: tiled_loss needs a causal LM whose head is `lm_head`; {name} has "
                         f"{type(head).__name__ if head is not None else 'no output embeddings'}. Turn tiled_loss off.")
    check_head(head, f"{name}.lm_head")
    config = getattr(module, "config", None)
    for key, neutral in _LOGIT_TRANSFORMS.items():
        value = getattr(config, key, None)
        if value is not None and value != neutral:
            raise ValueError(f"zero_strategy: tiled_loss cannot reproduce {name}'s loss: its config sets "
                             f"{key}={value!r}, which transforms the logits after the head. Turn tiled_loss off "
                             "for this model.")
    loss_function = getattr(module, "loss_function", None)
    if getattr(loss_function, "__name__", None) != "ForCausalLMLoss":
        raise ValueError(f"zero_strategy: tiled_loss computes transformers' ForCausalLMLoss, but {name}'s "
                         f"loss_function is {getattr(loss_function, '__name__', loss_function)!r} (a loss_type or "
                         "a loss of your own). Turn tiled_loss off, or call zero_strategy.tiled_causal_lm_loss "
                         "in a loss of your own.")
    transform = _logits_changed_after_head(type(module).forward)
    if transform is not None:
        raise ValueError(f"zero_strategy: tiled_loss cannot reproduce {name}'s loss: its forward changes the "
                         f"logits after the head (`{transform}`). Turn tiled_loss off for this model.")


def _logits_changed_after_head(forward: Callable) -> str | None:
    """The first line of ``forward`` that rewrites ``logits`` between the head and the loss, if any
    (a class whose source cannot be read is taken on its config's word)."""
    try:
        lines = inspect.getsource(forward).splitlines()
    except (OSError, TypeError):
        return None
    at = next((i for i, line in enumerate(lines) if "self.lm_head(" in line), None)
    if at is None:
        return "no `self.lm_head(...)` call"
    if "+" in lines[at].split("self.lm_head(", 1)[1]:
        return lines[at].strip()
    for line in lines[at + 1:]:
        if "loss_function(" in line or "loss = " in line:
            return None
        if _ASSIGNS_LOGITS.match(line):
            return line.strip()
    return None


def causal_lm_forward(module: nn.Module, chunk_tokens: int | None) -> Callable[[Callable], Callable]:
    """``make(original) -> forward`` for _model/install.py: ``module``'s forward with the tiled loss.
    See [Note: the tiled loss in a Hugging Face model]."""
    module_ref = weakref.ref(module)  # the module holds the wrapper: no cycle

    def make(original: Callable) -> Callable:
        signature = inspect.signature(original)

        def forward(*args, **kwargs):
            model = module_ref()
            call = _keywords(signature, args, kwargs)
            labels, shift_labels = call.pop("labels", None), call.pop("shift_labels", None)
            if (model is None or not model.training or (labels is None and shift_labels is None)
                    or not _keeps_all_logits(call.get("logits_to_keep", 0))):
                return original(*args, **kwargs)
            num_items_in_batch = call.pop("num_items_in_batch", None)
            ignore_index = call.pop("ignore_index", IGNORE_INDEX)
            if shift_labels is None:
                shift_labels = shifted(labels, ignore_index)
            head, found = model.lm_head, []

            def head_forward(hidden: torch.Tensor) -> torch.Tensor:
                found.append(tiled_cross_entropy(hidden, head.weight, head.bias, shift_labels,
                                                 num_items_in_batch=num_items_in_batch,
                                                 ignore_index=ignore_index, chunk_tokens=chunk_tokens))
                return found[-1]

            with _forward_replaced(head, head_forward):
                out = original(**call)
            if len(found) != 1:
                raise RuntimeError(f"zero_strategy: tiled_loss expected {type(model).__name__}'s forward to call "
                                   f"lm_head once, it called it {len(found)} times. Turn tiled_loss off.")
            if isinstance(out, tuple):  # return_dict=False: (loss, <no logits>, ...)
                return (found[0],) + tuple(out[1:])
            fields = {k: v for k, v in out.items() if k not in ("loss", "logits")}
            return type(out)(loss=found[0], logits=None, **fields)
        return forward
    return make


def _keywords(signature: inspect.Signature, args: tuple, kwargs: dict) -> dict:
    """The call's arguments by name, ``**kwargs`` spread out."""
    bound = signature.bind_partial(*args, **kwargs)
    call = {}
    for name, value in bound.arguments.items():
        if signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
            call.update(value)
        elif signature.parameters[name].kind is inspect.Parameter.VAR_POSITIONAL:
            raise TypeError("zero_strategy: tiled_loss cannot pass on extra positional arguments")
        else:
            call[name] = value
    return call


def _keeps_all_logits(logits_to_keep) -> bool:
    return isinstance(logits_to_keep, int) and logits_to_keep == 0
