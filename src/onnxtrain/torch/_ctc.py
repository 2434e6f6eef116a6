"""Connectionist temporal classification loss as the capture traces it.

``F.ctc_loss`` runs ``aten._ctc_loss``, whose output shape the capture cannot know (it depends on
the targets' lengths): every module computing a CTC loss ran in PyTorch. While capturing,
``F.ctc_loss`` (and ``nn.CTCLoss``, which calls it) is :func:`ctc_loss`: the forward (alpha)
recursion over the frames as one torch ``scan``, which the exporter writes as an ONNX ``Scan`` and
the gradient graph differentiates (``autodiff/rules/control.py``), so the loss and its gradient
run in ONNX Runtime.

The recursion runs in log space, with a large finite number standing for an impossible state
(``log 0``): no ``-inf - -inf`` arises, in the forward or the gradient. A sample whose targets
cannot be aligned within its frames gets an infinite loss (zero with ``zero_infinity``), as in
PyTorch. The gradient is PyTorch's: its formula for the log-probabilities is the one through a
``log_softmax`` (it carries an extra ``exp(log_probs)`` over each sample's frames, which a
``log_softmax`` before the loss sums away), and so is this one's.
"""

from __future__ import annotations

import torch

from onnxtrain.torch._packed import running_steps

# log 0 of the recursion: impossible states stay near it (log-probabilities added to it vanish
# in its rounding), and a sample none of whose alignments is possible ends below half of it
_IMPOSSIBLE = -1.0e30
_REDUCTIONS = ("none", "mean", "sum")


def _padded_targets(targets, target_lengths, batch: int):
    """Targets as ``[N, S]``: padded ones as they are, concatenated ones (1-D, each sample's
    ``target_lengths[n]`` labels in turn) spread over rows as long as all of them together (the
    longest a row can be without reading the lengths' values)."""
    if targets.dim() == 2:
        return targets
    if targets.dim() != 1:
        raise ValueError(f"ctc_loss targets must be 1-D (concatenated) or 2-D (padded), got {targets.dim()}-D")
    total = targets.shape[0]
    if total == 0:
        return targets.new_zeros((batch, 0))
    starts = torch.cumsum(target_lengths, 0) - target_lengths
    places = starts.unsqueeze(1) + torch.arange(total, device=targets.device).unsqueeze(0)
    return targets[places.clamp(max=total - 1)]


def ctc_loss(log_probs, targets, input_lengths, target_lengths, blank: int = 0, reduction: str = "mean",
             zero_infinity: bool = False):
    """``F.ctc_loss`` with the same arguments and results, written in torch ops and one ``scan``
    over the frames (see the module's docstring). Lengths may be tensors or sequences of ints;
    targets padded (``[N, S]``) or concatenated (1-D)."""
    if reduction not in _REDUCTIONS:
        raise ValueError(f"{reduction} is not a valid value for reduction")
    from torch._higher_order_ops.scan import scan

    unbatched = log_probs.dim() == 2
    device = log_probs.device
    input_lengths = torch.as_tensor(input_lengths, dtype=torch.long, device=device).reshape(-1)
    target_lengths = torch.as_tensor(target_lengths, dtype=torch.long, device=device).reshape(-1)
    if unbatched:
        log_probs = log_probs.unsqueeze(1)
        targets = targets.unsqueeze(0)  # the one sample's labels, as a padded row
    wanted = log_probs.dtype
    if wanted.itemsize < 4:  # half precision cannot hold the impossible state
        log_probs = log_probs.float()
    frames, batch, _ = log_probs.shape
    targets = _padded_targets(targets.long(), target_lengths, batch)
    # the extended labels: a blank before, between and after each sample's targets
    width = 2 * targets.shape[1] + 1
    labels = torch.full((batch, width), blank, dtype=torch.long, device=device)
    labels[:, 1::2] = targets
    emissions = log_probs.gather(2, labels.unsqueeze(0).expand(frames, batch, width)).clamp(min=_IMPOSSIBLE)
    # a state may be reached from two before when it is a label other than the one two before
    two_before = torch.cat([torch.full_like(labels[:, :2], blank), labels[:, :-2]], 1)
    skips = (labels != blank) & (labels != two_before)
    running = running_steps(input_lengths, frames)  # [T, N]
    impossible = torch.full((batch, 1), _IMPOSSIBLE, dtype=log_probs.dtype, device=device)
    # before the first frame: at state 0 with certainty, so that frame 0 may start at state 0 or 1
    start = torch.cat([torch.zeros_like(impossible), impossible.expand(batch, width - 1)], 1)

    def frame(alpha, inputs):
        emission, runs = inputs
        one = torch.cat([impossible, alpha[:, :-1]], 1)
        two = torch.where(skips, torch.cat([impossible, impossible, alpha[:, :-2]], 1), impossible)
        top = torch.maximum(torch.maximum(alpha, one), two)
        reached = top + torch.log(torch.exp(alpha - top) + torch.exp(one - top) + torch.exp(two - top)) + emission
        after = torch.where(runs.unsqueeze(1), reached, alpha)  # past a sample's frames, it stays
        return after, after.clone()

    final, _ = scan(frame, start, (emissions, running))
    ends = 2 * target_lengths
    last = final.gather(1, ends.unsqueeze(1)).squeeze(1)
    before_last = final.gather(1, (ends - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
    before_last = torch.where(target_lengths > 0, before_last, torch.full_like(before_last, _IMPOSSIBLE))
    likelihood = torch.logaddexp(last, before_last)
    # PyTorch's gradient for the log-probabilities adds exp(log_probs) over each sample's frames:
    # a term valued zero that carries it
    spread = (log_probs.exp() * running.unsqueeze(2)).sum((0, 2))
    loss = (spread - spread.detach()) - likelihood
    infeasible = likelihood < _IMPOSSIBLE / 2
    loss = torch.where(infeasible, torch.full_like(loss, 0.0 if zero_infinity else float("inf")), loss)
    loss = loss.to(wanted)
    if unbatched:
        loss = loss.squeeze(0)
    if reduction == "mean":
        return (loss / target_lengths.clamp(min=1).to(loss.dtype)).mean()
    return loss.sum() if reduction == "sum" else loss
