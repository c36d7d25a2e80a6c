"""Many models of one architecture as one: parameters stacked on a leading member axis.

``StackedModel(models)`` stacks the members' parameters and buffers (``torch.func``'s
``stack_module_state``) and runs them with ``vmap`` over ``functional_call`` of one weightless
template, so any registered model works and M members cost one batched kernel per layer
instead of M small ones. A model may offer a faster batched form, ``forward_stacked(params, x)``
with x of shape (M, B, ...), which is used instead (the MLP: batched matmuls). Members can
leave (``keep``), which shrinks every stacked tensor.

Rows can be run in ``chunks``, each as a stack of its own: a pack's runs (mdl.engine.stacked_runs) then compute
exactly as they do alone. Grouped convolutions (and vmap's, which are grouped convolutions too) give a
member other last bits in a stack of another size. A model whose stacked form does not
(``stack_size_independent``: the MLP's batched matmuls, tests/test_pack.py) runs all rows as one stack on a
GPU, where kernel launches bind small steps; on a CPU, which is arithmetic-bound, chunks are faster (each
run's stack stays cache-sized: per training step on one thread, 1.11x for 25 digits MLP runs of 11 members and 1.68x
for 6 LeNet runs, timed once by hand with StackedClassifier.train_group; whole sweeps: docs/sweeps.md).

muP: the template's ``MuReadout`` layers read their width multiplier from ``weight.infshape``,
which the stacked tensors do not carry; it is frozen to each readout's value before stacking.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

import torch
from mup import MuReadout
from torch import Tensor, nn
from torch.func import functional_call, stack_module_state, vmap

from models import stacked_ops
from models.mup_setup import mup_param_groups, restore_base_shapes


class StackedModel(nn.Module):
    """M models with identical architecture; ``forward(x)`` takes x of shape (M, B, ...)."""

    def __init__(self, models: Sequence[nn.Module], channels_last: bool = False) -> None:
        """``channels_last``: a stack of one keeps its image weights and inputs channels-last (``trainer.channels_last``)."""
        super().__init__()
        if not models:
            raise ValueError("StackedModel needs at least one model")
        # a stack of one runs its plain model (batch norm, dropout, stochastic depth and channels-last work there);
        # decided once: a larger stack whose members left keeps its stacked form (its members' bits stay its own)
        self.single = len(models) == 1
        self.channels_last = channels_last and self.single
        if not self.single:
            _require_stackable(models[0])
        shapes = {n: p.shape for n, p in models[0].named_parameters()}
        for m in models[1:]:
            if {n: p.shape for n, p in m.named_parameters()} != shapes:
                raise ValueError("every stacked model must have the same architecture")
        # Not a submodule: it holds no tensors, and .to()/.cpu() (Lightning's teardown) must not touch it.
        self.__dict__["template"] = _weightless_template(models[0])
        if self.single:  # where the one member's tensors are bound for each call (_bound)
            self.__dict__["slots"] = _slots(self.template)
            # the member axis added as a view: a channels-last weight stays channels-last
            model = models[0].to(memory_format=torch.channels_last) if self.channels_last else models[0]
            params = {n: p.detach().unsqueeze(0) for n, p in model.named_parameters()}
            buffers = {n: b.unsqueeze(0) for n, b in model.named_buffers()}
        else:
            params, buffers = stack_module_state(list(models))
        self.names = list(params)
        self.buffer_names = list(buffers)
        self.stacked = nn.ParameterList([nn.Parameter(params[n].detach()) for n in self.names])
        for i, n in enumerate(self.buffer_names):
            self.register_buffer(f"stacked_buffer_{i}", buffers[n])
        self.width_mult = _mup_width_mults(models[0])  # name -> muP lr divisor (1 for vector-like parameters)

    @property
    def num_members(self) -> int:
        return self.stacked[0].shape[0]

    def param_dict(self) -> dict[str, Tensor]:
        # ParameterList's own iteration resolves every index through string keys: a measurable host
        # cost per step for small models, where the host is the bottleneck
        return dict(zip(self.names, self.stacked._parameters.values()))

    def buffer_dict(self) -> dict[str, Tensor]:
        return {n: getattr(self, f"stacked_buffer_{i}") for i, n in enumerate(self.buffer_names)}

    as_trained = False  # a stack of one scores in train mode (LoopRules.evaluate_as_trained)

    def train(self, mode: bool = True) -> StackedModel:
        """The template is no submodule, so its mode follows the stack's here (stochastic depth in a model's
        ``forward_stacked`` reads it)."""
        super().train(mode)
        self.template.train(mode)
        return self

    def forward(self, x: Tensor, chunks: Sequence[int] | None = None) -> Tensor:
        return self.run(self.param_dict(), self.buffer_dict(), x, shared_input=False, chunks=chunks)

    def compile(self, backend: str) -> None:  # type: ignore[override]
        """Compile the stacked computation once for the whole fit (``trainer.compile``). Members leave, so the
        member axis shrinks: it is marked dynamic (``run``), so one graph serves every stack size instead of one
        per size; training and evaluation (autograd on or off, one batch per member or one shared) and a stack
        of one member (which dynamo specialises) get their own graphs (tests/test_one_engine.py counts them)."""
        regional = getattr(self.template, "compile_stacked", None)
        if (
            regional is not None and not self.single
        ):  # the model compiles its repeated block itself (models.convnext_stacked)
            regional(backend)
            return
        import torch._dynamo

        # dynamo takes parameters' shapes as static by default: the stacked weights' member axis must not be
        torch._dynamo.config.force_parameter_static_shapes = False
        # one compiled function for a batch per member and one for a batch all members share: a single one, seeing
        # x of shape (B, C, H, W) and then (M, B, C, H, W), made every axis of x symbolic, which inductor failed on
        self.__dict__["_compiled_run"] = {
            False: torch.compile(self._run_own_batches, backend=backend),
            True: torch.compile(self._run_shared_batch, backend=backend),
        }

    def run(
        self,
        params: dict[str, Tensor],
        buffers: dict[str, Tensor],
        x: Tensor,
        shared_input: bool,
        chunks: Sequence[int] | None = None,
    ) -> Tensor:
        """Outputs (M', B, K) of the members whose stacked weights are given; x is (M', B, ...)
        or, with ``shared_input``, one batch (B, ...) that every member sees. ``chunks``: sizes of consecutive
        groups of rows that each compute as a stack of their own (None: one stack)."""
        if chunks is None or len(chunks) < 2 or runs_as_one_stack(self.template, x.device):
            return self._run_one(params, buffers, x, shared_input)
        # split (not sliced) views: autograd concatenates their gradients once instead of adding padded copies
        split_params = {n: t.split(list(chunks)) for n, t in params.items()}
        split_buffers = {n: t.split(list(chunks)) for n, t in buffers.items()}
        split_x = [x] * len(chunks) if shared_input else x.split(list(chunks))
        return torch.cat(
            [
                self._run_one(
                    {n: t[i] for n, t in split_params.items()},
                    {n: t[i] for n, t in split_buffers.items()},
                    split_x[i],
                    shared_input,
                )
                for i in range(len(chunks))
            ]
        )

    def _run_one(self, params: dict[str, Tensor], buffers: dict[str, Tensor], x: Tensor, shared_input: bool) -> Tensor:
        compiled = self.__dict__.get("_compiled_run")
        if compiled is None:
            return self._run(params, buffers, x, shared_input)
        # the member axis, and the batch axis (a prefix shorter than a batch, the last eval batch)
        members = (*params.values(), *buffers.values(), *(() if shared_input else (x,)))
        stacked_ops.mark_dynamic(members, x, (0 if shared_input else 1,))
        return compiled[shared_input](params, buffers, x)

    def _run_own_batches(self, params: dict[str, Tensor], buffers: dict[str, Tensor], x: Tensor) -> Tensor:
        return self._run(params, buffers, x, shared_input=False)

    def _run_shared_batch(self, params: dict[str, Tensor], buffers: dict[str, Tensor], x: Tensor) -> Tensor:
        return self._run(params, buffers, x, shared_input=True)

    def _run(self, params: dict[str, Tensor], buffers: dict[str, Tensor], x: Tensor, shared_input: bool) -> Tensor:
        if self.single:
            return self._run_plain(params, buffers, x if shared_input else x[0])[None]
        batched = getattr(self.template, "forward_stacked", None)
        if batched is not None:  # the model's own batched form (e.g. the MLP as batched matmuls)
            if shared_input:
                x = x.expand(next(iter(params.values())).shape[0], *x.shape)
            return batched(params, x)

        def one(p: dict[str, Tensor], b: dict[str, Tensor], xi: Tensor) -> Tensor:
            return functional_call(self.template, (p, b), (xi,))

        return vmap(one, in_dims=(0, 0, None if shared_input else 0))(params, buffers, x)

    def _run_plain(self, params: dict[str, Tensor], buffers: dict[str, Tensor], x: Tensor) -> Tensor:
        """The one member's plain model on x (B, ...). Scored under no_grad as a lone model is: in eval mode (batch
        norm's running statistics, no dropout), unless ``as_trained`` (protocol=original's train-mode scoring)."""
        training = self.training and (torch.is_grad_enabled() or self.as_trained)
        if self.template.training != training:
            self.template.train(training)
        if self.channels_last and x.ndim == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        buffers = {n: t.squeeze(0) for n, t in buffers.items()}
        compiling = torch.compiler.is_compiling()
        if torch.is_grad_enabled() and params.get(self.names[0]) is self.stacked[0] and not compiling:
            params = self._member_leaves()  # training: no view and no view's backward per parameter
        else:  # squeeze, not [0]: its backward is a view, select's a zeroed copy per parameter
            params = {n: t.squeeze(0) for n, t in params.items()}
        if compiling:  # dynamo traces functional_call, not writes into a module's dicts
            return functional_call(self.template, (params, buffers), (x,))
        with _bound(self.__dict__["slots"], (params, buffers)):
            return self.template(x)

    def _member_leaves(self) -> dict[str, nn.Parameter]:
        """A stack of one's parameters without the member axis: leaves that share their storage (so an optimizer
        step on the stack moves them too) and hand their gradient to the stack's parameter as it accumulates. A
        paper-MLP training step took 663 us with squeezed views, 605 us with these (one CPU thread, loaded); the
        gradients are the same to the bit. Made again when a parameter was replaced, moved (``keep``, ``.to``) or
        frozen or unfrozen. The stack's own parameters are then not in the autograd graph: hooks registered on them do
        not fire and ``torch.autograd.grad`` cannot take them (docs/engines.md)."""
        made = self.__dict__.get("leaves")  # (the parameters, their (data pointer, requires_grad), the leaves by name)
        stacked = self.stacked._parameters.values()
        if made is None or any(
            p is not q or (p.data_ptr(), p.requires_grad) != at for p, q, at in zip(stacked, *made[:2])
        ):
            stacked = list(stacked)
            state = [(p.data_ptr(), p.requires_grad) for p in stacked]
            made = (stacked, state, {n: _leaf_of(p) for n, p in zip(self.names, stacked)})
            self.__dict__["leaves"] = made
        return made[2]

    def _apply(self, fn: Any, recurse: bool = True) -> StackedModel:
        """A move (``.to``, ``.cuda``, ``.double``) forgets the leaves, which would keep the old tensors alive."""
        self.__dict__.pop("leaves", None)
        return super()._apply(fn, recurse)

    def keep(self, rows: Tensor) -> dict[nn.Parameter, nn.Parameter]:
        """Keep only the members at ``rows``; returns old -> new parameter (for the optimizer)."""
        replaced = {}
        for i, old in enumerate(self.stacked):
            new = nn.Parameter(old.detach()[rows].clone())
            self.stacked[i] = new
            replaced[old] = new
        for i in range(len(self.buffer_names)):
            name = f"stacked_buffer_{i}"
            setattr(self, name, getattr(self, name)[rows].clone())
        return replaced

    def resize(self, members: int) -> None:
        """Empty stacked tensors for ``members`` members (before loading a checkpoint of that size)."""
        for i, old in enumerate(self.stacked):
            same = old.shape[0] == members  # keeps its layout (a stack of one's channels-last weights)
            self.stacked[i] = nn.Parameter(torch.empty_like(old) if same else old.new_empty(members, *old.shape[1:]))
        for i in range(len(self.buffer_names)):
            name = f"stacked_buffer_{i}"
            old = getattr(self, name)
            setattr(self, name, old.new_empty(members, *old.shape[1:]))

    def param_groups(self, lr: float) -> list[dict[str, Any]]:
        """One optimizer group per muP learning rate, as ``mup_param_groups`` gives a single model."""
        groups: dict[float, list[nn.Parameter]] = {}
        for name, p in self.param_dict().items():
            groups.setdefault(self.width_mult[name], []).append(p)
        return [{"params": ps, "lr": lr / mult, "width_mult": mult} for mult, ps in sorted(groups.items())]


class StackedForm:
    """A model class with a stacked form in a module of its own (``stacked_form``: its ``forward_stacked(model, params,
    x, compiled_block)`` and ``compile_blocks(backend)``): a fit of several members runs that form instead of vmap over
    each member's forward, and ``compile_stacked`` (``StackedModel.compile`` asks) compiles its repeated block only."""

    stacked_form: Any

    def forward_stacked(self, params: dict[str, Tensor], x: Tensor) -> Tensor:
        return self.stacked_form.forward_stacked(self, params, x, self.__dict__.get("compiled_block"))

    def compile_stacked(self, backend: str) -> None:
        self.__dict__["compiled_block"] = self.stacked_form.compile_blocks(backend)


def runs_as_one_stack(template: nn.Module, device: torch.device) -> bool:
    """Whether ``run`` ignores its chunks: on a GPU, for a model whose members' bits do not depend on the
    stack's size (one stack: fewer kernel launches); on a CPU chunks are faster (see the module's docstring)."""
    return device.type == "cuda" and getattr(template, "stack_size_independent", False)


def _require_stackable(model: nn.Module) -> None:
    """Batch norm mixes the examples of a batch and dropout draws random numbers: under vmap the
    first would differ from a lone model and the second fails; refuse both with a way out."""
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm) or (
            isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0
        ):
            raise ValueError(
                f"{type(module).__name__} at {name or 'the top'} cannot be stacked (mdl.members_per_fit other than 1); "
                f"use mdl.members_per_fit=1 (one member per fit) for this model"
            )


def _leaf_of(member: nn.Parameter) -> nn.Parameter:
    """``member`` (1, ...) as a leaf without the member axis, on the same storage; its gradient goes to ``member``."""
    leaf = nn.Parameter(member.detach().squeeze(0), requires_grad=member.requires_grad)

    def hand_over(leaf: Tensor) -> None:
        grad = leaf.grad.unsqueeze(0)
        member.grad = grad if member.grad is None else member.grad + grad
        leaf.grad = None

    if leaf.requires_grad:
        leaf.register_post_accumulate_grad_hook(hand_over)
    return leaf


Slots = dict[str, tuple[dict[str, Any], str]]


def _slots(template: nn.Module) -> Slots:
    """Every parameter's and buffer's name -> (its module's ``_parameters`` or ``_buffers`` dict, its key there)."""
    slots: Slots = {}
    for prefix, module in template.named_modules():
        for table in (module._parameters, module._buffers):
            for key in table:
                slots[f"{prefix}.{key}" if prefix else key] = (table, key)
    return slots


@contextmanager
def _bound(slots: Slots, tensors: tuple[dict[str, Tensor], dict[str, Tensor]]) -> Iterator[None]:
    """The template computing with ``tensors`` (parameters, buffers), written straight into its modules' dicts
    and put back after. ``functional_call`` does the same but walks the module tree and checks for tied weights on
    every call: a paper-MLP training step took 1488 us with it, 1329 us with this, an evaluation forward 296 and
    197 us (one CPU thread, a loaded machine)."""
    bound = [(*slots[name], tensor) for table in tensors for name, tensor in table.items()]
    saved = [where[key] for where, key, _ in bound]
    try:
        for where, key, tensor in bound:
            where[key] = tensor
        yield
    finally:
        for (where, key, _), original in zip(bound, saved):
            where[key] = original


def _weightless_template(model: nn.Module) -> nn.Module:
    """A deep copy on the meta device, with MuReadout's width multiplier frozen to a constant."""
    template = copy.deepcopy(model)
    if hasattr(template, "_mup_infshapes"):
        restore_base_shapes(template)
    for module in template.modules():
        if isinstance(module, MuReadout):
            mult = float(module.weight.infshape.width_mult()) if hasattr(module.weight, "infshape") else 1.0
            module.width_mult = lambda mult=mult: mult  # read in forward; stacked tensors carry no infshape
    template._forward_pre_hooks.clear()  # the infshape re-attaching hook: nothing to re-attach to
    return template.to("meta")


def _mup_width_mults(model: nn.Module) -> dict[str, float]:
    """Every parameter's muP learning-rate divisor, as ``mup_param_groups`` groups them (1 without base shapes)."""
    if not hasattr(model, "_mup_infshapes"):
        return {n: 1.0 for n, _ in model.named_parameters()}
    ids = {id(p): n for n, p in model.named_parameters()}
    mults = {}
    for group in mup_param_groups(model, 1.0):
        for p in group["params"]:
            mults[ids[id(p)]] = group["width_mult"]
    return mults
