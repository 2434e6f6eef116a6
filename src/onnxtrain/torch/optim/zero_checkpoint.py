"""Sharded checkpoints of :class:`~onnxtrain.torch.optim.ZeroOptimizer`: one file per rank,
merged into a full optimizer state dict for any number of ranks.

A shard is an optimizer state dict whose ``"state"`` holds only the rank's own parameters,
keyed by their position in the parameter groups (group after group, as ``torch.optim``
numbers them), plus ``"zero"`` metadata: the format version, the rank, the world size, the
positions the rank owns and every parameter's shape. Shards are written with ``torch.save``
to a temporary file in the destination folder, fsynced and renamed over the destination,
and read back with ``torch.load(weights_only=True)`` (tensors and plain values only).
"""

from __future__ import annotations

import enum
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from onnxtrain.checkpoint import _atomic_write
from onnxtrain.errors import CheckpointError
from onnxtrain.paths import unreadable_file

META_KEY = "zero"
FORMAT_VERSION = 1
_SHARD_NAME = "optimizer_shard_{rank}_of_{world_size}.pt"
_SHARD_PATTERN = re.compile(r"optimizer_shard_(\d+)_of_(\d+)\.pt")


def shard_path(folder: str | os.PathLike, rank: int, world_size: int) -> Path:
    """Where rank ``rank`` of ``world_size`` writes its shard in ``folder``."""
    return Path(folder) / _SHARD_NAME.format(rank=rank, world_size=world_size)


def plain_values(group: dict) -> dict:
    """``group`` with its enum hyperparameters (FusedAdam's ``adam_w_mode=AdamWMode...``) as their
    integers: ``torch.load``'s default weights-only unpickler reads plain values only."""
    return {key: int(value) if isinstance(value, enum.IntEnum) else value for key, value in group.items()}


def save_shard(shard: dict, path: str | os.PathLike) -> None:
    """Write one shard (``ZeroOptimizer.state_dict()``: plain values, see :func:`plain_values`)
    atomically (temporary file, fsync, rename)."""
    _atomic_write(Path(path), lambda f: torch.save(shard, f))


def load_shard(path: str | os.PathLike) -> dict:
    """Read one shard; :class:`CheckpointError` if it is missing, unreadable or no shard."""
    path = Path(path)
    problem = unreadable_file(path)
    if problem:
        raise CheckpointError(f"ZeRO optimizer shard {str(path)!r} {problem}, expected a shard file")
    try:
        shard = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 -- torch raises many types for a bad file
        raise CheckpointError(f"cannot read ZeRO optimizer shard {str(path)!r}: {exc}") from exc
    _check_is_shard(shard, str(path))
    return shard


def consolidate_state_dict(shards: str | os.PathLike | Iterable[str | os.PathLike | dict]) -> dict:
    """Merge the shards of every rank into a full optimizer state dict.

    ``shards`` is a folder (every ``optimizer_shard_<rank>_of_<world size>.pt`` in it), a
    list of shard files, or a list of shard dicts (``ZeroOptimizer.state_dict()`` of each
    rank). The result is an ordinary ``torch.optim`` state dict: it loads into a
    :class:`ZeroOptimizer` on any number of ranks (each keeps its own parameters' state) and
    into the plain optimizer built on the same parameter groups. Each group's
    hyperparameters (``lr``, FusedAdam's ``step``, ...) come from the lowest rank that owns
    one of its parameters. Raises :class:`CheckpointError` for missing, duplicate or
    mismatched shards.

    Example:
        >>> optimizer.save_shard("ckpt")                    # on each of 2 ranks
        >>> full = consolidate_state_dict("ckpt")           # later, anywhere
        >>> FusedAdam(model.parameters()).load_state_dict(full)
    """
    loaded = _load_all(shards)
    by_rank = _check_complete(loaded)
    owners = {position: rank for rank, shard in by_rank.items() for position in shard[META_KEY]["owned"]}
    state = {}
    for label, shard in loaded:
        rank = shard[META_KEY]["rank"]
        for position, value in shard["state"].items():
            if owners.get(position) != rank:
                raise CheckpointError(f"{label} holds state for parameter {position}, which rank {rank} does not own")
            state[position] = value
    groups, position = [], 0
    for index, group in enumerate(by_rank[0]["param_groups"]):
        count = len(group["params"])
        owner = min((owners[p] for p in range(position, position + count)), default=0)
        groups.append({**by_rank[owner]["param_groups"][index], "params": list(range(position, position + count))})
        position += count
    return {"state": dict(sorted(state.items())), "param_groups": groups}


def check_shapes(saved: Sequence[Sequence[int]], actual: Sequence[Sequence[int]], what: str) -> None:
    """:class:`CheckpointError` naming every parameter whose saved shape differs."""
    if len(saved) != len(actual):
        raise CheckpointError(f"{what} is for {len(saved)} parameters, the optimizer has {len(actual)}")
    wrong = [f"parameter {i}: saved {list(s)}, now {list(a)}" for i, (s, a) in enumerate(zip(saved, actual))
             if list(s) != list(a)]
    if wrong:
        raise CheckpointError(f"{what} does not match the parameters: " + "; ".join(wrong[:8]))


def _load_all(shards) -> list[tuple[str, dict]]:
    if isinstance(shards, (str, os.PathLike)):
        folder = Path(shards)
        if not folder.is_dir():
            raise CheckpointError(f"ZeRO checkpoint folder {str(folder)!r} does not exist")
        paths = sorted(p for p in folder.iterdir() if _SHARD_PATTERN.fullmatch(p.name))
        if not paths:
            raise CheckpointError(f"no ZeRO optimizer shards (optimizer_shard_<rank>_of_<world size>.pt) "
                                  f"in {str(folder)!r}")
        shards = paths
    loaded = []
    for item in shards:
        if isinstance(item, dict):
            _check_is_shard(item, "a state dict given to consolidate_state_dict")
            loaded.append((f"the shard of rank {item[META_KEY]['rank']}", item))
        else:
            loaded.append((str(item), load_shard(item)))
    if not loaded:
        raise CheckpointError("consolidate_state_dict got no shards")
    return loaded


def _check_is_shard(shard, label: str) -> None:
    if not isinstance(shard, dict) or not isinstance(shard.get(META_KEY), dict) or \
            not {"state", "param_groups"} <= shard.keys():
        raise CheckpointError(f"{label} is not a ZeRO optimizer shard (ZeroOptimizer.state_dict() of one rank)")
    version = shard[META_KEY].get("format")
    if version != FORMAT_VERSION:
        raise CheckpointError(f"{label} has shard format {version!r}; this onnxtrain reads format {FORMAT_VERSION}")


def _check_complete(loaded: Sequence[tuple[str, dict]]) -> dict[int, dict]:
    """Every rank of one save exactly once, with the same parameters and groups."""
    sizes = sorted({shard[META_KEY]["world_size"] for _, shard in loaded})
    if len(sizes) > 1:
        raise CheckpointError(f"shards of different saves: world sizes {sizes} "
                              f"({', '.join(label for label, _ in loaded)})")
    world_size = sizes[0]
    ranks = [shard[META_KEY]["rank"] for _, shard in loaded]
    duplicates = sorted({r for r in ranks if ranks.count(r) > 1})
    missing = sorted(set(range(world_size)) - set(ranks))
    if duplicates or missing:
        raise CheckpointError(f"a {world_size}-rank save needs one shard per rank: missing ranks {missing}, "
                              f"duplicate ranks {duplicates}")
    by_rank = {shard[META_KEY]["rank"]: shard for _, shard in loaded}
    reference = by_rank[0]
    structure = [len(g["params"]) for g in reference["param_groups"]]
    owned = []
    for label, shard in loaded:
        meta = shard[META_KEY]
        check_shapes(meta["shapes"], reference[META_KEY]["shapes"], label)
        if [len(g["params"]) for g in shard["param_groups"]] != structure:
            raise CheckpointError(f"{label} has parameter groups of sizes "
                                  f"{[len(g['params']) for g in shard['param_groups']]}, rank 0's has {structure}")
        owned.extend(meta["owned"])
    total = len(reference[META_KEY]["shapes"])
    if sorted(owned) != list(range(total)):
        raise CheckpointError(f"the shards do not own each of the {total} parameters exactly once")
    return by_rank
