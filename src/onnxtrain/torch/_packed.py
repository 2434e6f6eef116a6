"""Packed sequences as the capture traces them: padded batches with their lengths.

``pack_padded_sequence`` packs a padded batch into a tensor whose size is the sum of the lengths
(data-dependent), and a recurrent layer given a ``PackedSequence`` runs a kernel that reads its
``batch_sizes`` as numbers: every module using packed sequences ran in PyTorch. While capturing
(:func:`packed_sequences_padded`):

- ``pack_padded_sequence`` keeps the batch padded, time first (sorted by length first where
  PyTorch sorts, ``enforce_sorted=False``), with empty ``batch_sizes``, and notes each sequence's
  length;
- ``nn.LSTM``, ``nn.GRU`` and ``nn.RNN`` given such a sequence run each layer and direction as one
  torch ``scan`` over the steps (an ONNX ``Scan``, which the gradient graph differentiates) that
  holds a sequence's state past its length and writes zeros there, a reverse direction reading
  each sequence backwards from its own last step, as PyTorch's packed kernels do; the hidden
  state goes back to the caller's batch order;
- ``pad_packed_sequence`` returns the padded output (``padding_value`` past each length), as long
  as the longest sequence (or ``total_length``), and the lengths.

The same values and gradients as PyTorch's packed path; the steps past a sequence's length are
computed and discarded (the cost of the padded batch).
"""

from __future__ import annotations

import contextlib
import functools

import torch


class _Lengths:
    """The lengths of the padded batches standing in for packed ones during one capture, by the
    identity of their (padded, time-first) data."""

    def __init__(self):
        self._by_data: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def note(self, data: torch.Tensor, lengths: torch.Tensor) -> None:
        self._by_data[id(data)] = (data, lengths)

    def of(self, data: torch.Tensor) -> torch.Tensor | None:
        entry = self._by_data.get(id(data))
        return entry[1] if entry is not None and entry[0] is data else None


def running_steps(lengths: torch.Tensor, steps: int) -> torch.Tensor:
    """``[T, B]``: whether each sequence still runs at each step."""
    return torch.arange(steps, device=lengths.device).unsqueeze(1) < lengths.unsqueeze(0)


def _reversed_within_lengths(x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``x`` (``[T, B, F]``) with each sequence's first ``length`` steps in reverse order, the rest
    where they were: what a reverse direction reads (its own inverse)."""
    steps = x.shape[0]
    t = torch.arange(steps, device=x.device).unsqueeze(1)
    ends = lengths.unsqueeze(0)
    index = torch.where(t < ends, ends - 1 - t, t)  # [T, B]
    return x.gather(0, index.unsqueeze(2).expand(-1, -1, x.shape[2]))


def _weights(module: torch.nn.RNNBase, layer: int, reverse: bool) -> dict[str, torch.Tensor | None]:
    suffix = f"_l{layer}{'_reverse' if reverse else ''}"
    return {name: getattr(module, f"{name}{suffix}", None) for name in
            ("weight_ih", "weight_hh", "bias_ih", "bias_hh", "weight_hr")}


def _cell(module: torch.nn.RNNBase, w: dict):
    """The step of ``module``'s recurrence: ``(state, projected input) -> (state, output)``, the
    input already multiplied by ``weight_ih`` (plus ``bias_ih``)."""
    mode = module.mode

    def hidden_product(h):
        product = h @ w["weight_hh"].t()
        return product + w["bias_hh"] if w["bias_hh"] is not None else product

    if mode == "LSTM":
        def lstm(state, projected):
            h, c = state
            i, f, g, o = (projected + hidden_product(h)).chunk(4, dim=-1)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            h = torch.sigmoid(o) * torch.tanh(c)
            if w["weight_hr"] is not None:
                h = h @ w["weight_hr"].t()
            return (h, c), h
        return lstm
    if mode == "GRU":
        def gru(state, projected):
            (h,) = state
            x_r, x_z, x_n = projected.chunk(3, dim=-1)
            h_r, h_z, h_n = hidden_product(h).chunk(3, dim=-1)
            r, z = torch.sigmoid(x_r + h_r), torch.sigmoid(x_z + h_z)
            n = torch.tanh(x_n + r * h_n)
            h = (1 - z) * n + z * h
            return (h,), h
        return gru
    activation = torch.tanh if mode == "RNN_TANH" else torch.relu

    def rnn(state, projected):
        (h,) = state
        h = activation(projected + hidden_product(h))
        return (h,), h
    return rnn


def _direction(module, x, lengths, running, state, layer: int, reverse: bool):
    """One layer and direction over ``x`` (``[T, B, F]``): its outputs (zeros past each length)
    and final state (each sequence's at its last step)."""
    from torch._higher_order_ops.scan import scan

    w = _weights(module, layer, reverse)
    if reverse:
        x = _reversed_within_lengths(x, lengths)
    projected = x @ w["weight_ih"].t()
    if w["bias_ih"] is not None:
        projected = projected + w["bias_ih"]
    cell = _cell(module, w)

    def step(carried, inputs):
        projected_t, runs = inputs
        runs = runs.unsqueeze(1)
        new, out = cell(carried, projected_t)
        held = [torch.where(runs, n, old) for n, old in zip(new, carried)]
        return held, torch.where(runs, out, torch.zeros_like(out))

    final, outputs = scan(step, list(state), (projected, running))
    if reverse:
        outputs = _reversed_within_lengths(outputs, lengths)
    return outputs, final


def _run_padded(module: torch.nn.RNNBase, data, lengths, hx, sorted_indices, unsorted_indices):
    """``module`` over a padded, time-first batch standing in for a packed one: the padded output
    and the final state (in the caller's batch order), as PyTorch's packed kernels compute them."""
    steps, batch = data.shape[0], data.shape[1]
    directions = 2 if module.bidirectional else 1
    lstm = module.mode == "LSTM"
    out_size = module.proj_size if lstm and module.proj_size > 0 else module.hidden_size
    if hx is None:
        h0 = data.new_zeros(module.num_layers * directions, batch, out_size)
        hx = (h0, data.new_zeros(module.num_layers * directions, batch, module.hidden_size)) if lstm else (h0,)
    else:
        hx = tuple(hx) if lstm else (hx,)
        if sorted_indices is not None:  # the caller's order -> the batch's (sorted) order
            hx = tuple(h.index_select(1, sorted_indices) for h in hx)
    running = running_steps(lengths, steps)
    finals: list[list[torch.Tensor]] = [[] for _ in hx]
    x = data
    for layer in range(module.num_layers):
        outputs = []
        for reverse in range(directions):
            index = layer * directions + reverse
            out, final = _direction(module, x, lengths, running, [h[index] for h in hx], layer, bool(reverse))
            outputs.append(out)
            for collected, value in zip(finals, final):
                collected.append(value)
        x = torch.cat(outputs, dim=2) if directions == 2 else outputs[0]
        if module.dropout and module.training and layer < module.num_layers - 1:
            x = torch.nn.functional.dropout(x, module.dropout, training=True)
    state = tuple(torch.stack(collected, 0) for collected in finals)
    if unsorted_indices is not None:
        state = tuple(h.index_select(1, unsorted_indices) for h in state)
    return x, (state if lstm else state[0])


@contextlib.contextmanager
def packed_sequences_padded(module: torch.nn.Module):
    """While capturing, packed sequences stay padded (see the module's docstring); ``module``'s
    recurrent layers run them as masked scans."""
    from torch import _VF
    from torch.nn.utils.rnn import PackedSequence

    from onnxtrain.torch._exporter import _replaced

    lengths_of = _Lengths()

    def pack(input, lengths, batch_first):
        data = input.transpose(0, 1) if batch_first else input
        lengths = lengths.to(torch.int64)
        lengths_of.note(data, lengths)
        # no batch sizes: pad_packed_sequence then passes total_length as given, or 0 for none
        # (PyTorch's lengths are all positive, so a given total_length is never 0)
        return data, lengths.new_zeros(0)

    def pad(data, batch_sizes, batch_first, padding_value, total_length):
        lengths = lengths_of.of(data)
        if lengths is None:
            raise NotImplementedError("pad_packed_sequence of a PackedSequence not made by pack_padded_sequence")
        steps = data.shape[0]
        if total_length == 0:  # none given: as long as the longest
            longest = lengths.max().item()
            torch._check(longest <= steps)
            torch._check(longest >= 0)
            data = data[:longest]
        elif total_length > steps:
            data = torch.cat([data, data.new_zeros(total_length - steps, *data.shape[1:])], 0)
        else:
            data = data[:total_length]
        if padding_value != 0.0:
            data = torch.where(running_steps(lengths, data.shape[0]).unsqueeze(2), data,
                               torch.full_like(data, padding_value))
        return (data.transpose(0, 1) if batch_first else data), lengths

    def padded_forward(rnn, original, input, hx=None):
        if not (isinstance(input, PackedSequence) and input.data.dim() == 3):
            return original(input, hx)
        lengths = lengths_of.of(input.data)
        if lengths is None:
            raise NotImplementedError(f"{type(rnn).__name__} given a PackedSequence not made by pack_padded_sequence")
        output, state = _run_padded(rnn, input.data, lengths.to(input.data.device), hx, input.sorted_indices,
                                    input.unsorted_indices)
        lengths_of.note(output, lengths)
        return PackedSequence(output, input.batch_sizes, input.sorted_indices, input.unsorted_indices), state

    # each layer's forward as it is now (another capture patch may have replaced it already)
    forwards = [(rnn, "forward", functools.partial(padded_forward, rnn, rnn.forward))
                for rnn in module.modules() if isinstance(rnn, torch.nn.RNNBase)]
    with _replaced((_VF, "_pack_padded_sequence", pack), (_VF, "_pad_packed_sequence", pad), *forwards):
        yield
