"""``torch.cov`` and ``torch.corrcoef`` as the capture traces them.

PyTorch's kernels warn when the normalization factor is not positive, a branch on the data
(``aten.equal``) that the capture cannot trace, so a module computing either ran in PyTorch.
The functions here compute the same values with the same ops (so autograd, and the exported
gradient, differentiate the same composition) and take a factor at or below 0 as 0, as
PyTorch does after warning: the covariances are then infinite or NaN.
"""

from __future__ import annotations

import torch


def cov(input: torch.Tensor, *, correction: int = 1, fweights: torch.Tensor | None = None,
        aweights: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.cov``: rows are variables, columns observations (a vector is one variable)."""
    if input.dim() > 2:
        raise ValueError(f"cov(): expected input to have two or fewer dimensions but got an input with "
                         f"{input.dim()} dimensions")
    if fweights is not None and (fweights.is_floating_point() or fweights.is_complex()):
        raise TypeError(f"cov(): expected fweights to have integral dtype but got fweights with {fweights.dtype} dtype")
    if aweights is not None and not aweights.is_floating_point():
        raise TypeError(f"cov(): expected aweights to have floating point dtype but got aweights with {aweights.dtype} "
                        f"dtype")
    observations = input.view(1, -1) if input.dim() < 2 else input
    count = observations.shape[1]
    weights = fweights
    if aweights is not None:
        weights = aweights if weights is None else weights * aweights
    if weights is None:
        weight_sum = torch.tensor(float(count), dtype=observations.dtype.to_real())
        mean = observations.mean(dim=1)
    else:
        weight_sum = weights.sum()
        mean = (observations * weights).sum(dim=1) / weight_sum
    if weights is not None and aweights is not None and correction != 0:
        factor = weight_sum - correction * (weights * aweights).sum() / weight_sum
    else:
        factor = weight_sum - correction
    factor = factor.clamp(min=0)  # PyTorch warns and divides by 0
    centered = observations - mean.unsqueeze(1)
    weighted = centered if weights is None else centered * weights
    return (centered @ weighted.t().conj()).true_divide(factor).squeeze()


def corrcoef(input: torch.Tensor) -> torch.Tensor:
    """``torch.corrcoef``: Pearson's coefficients of the rows, real ones clipped to [-1, 1]."""
    covariance = cov(input)
    if covariance.dim() == 0:
        return covariance / covariance
    diagonal = covariance.diagonal()
    deviation = torch.sqrt(diagonal.real if diagonal.is_complex() else diagonal)
    covariance = covariance / deviation.view(-1, 1)
    covariance = covariance / deviation.view(1, -1)
    if covariance.is_complex():
        return torch.complex(covariance.real.clip(-1, 1), covariance.imag.clip(-1, 1))
    return covariance.clip(-1, 1)
