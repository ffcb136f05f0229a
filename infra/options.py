"""A Config field's facts and the checks each field takes alone. Its doors: config.py declares every
field with `option` and calls `check_fields` first in Config.__post_init__; cli.py prints each field's
help, checkpoint.resumable reads which fields a resumed run may change. Pure Python, no torch.
"""

import math
from dataclasses import MISSING, field, fields
from typing import Literal, get_args, get_origin


def option(default, help, low=None, above=None, high=None, below=None, note="", only_with=None, resumable=False):
    """A Config field and its facts (field metadata): the default, the line `train.py --help` prints,
    its bounds (value >= low or > above, <= high or < below; None passes; `note` says what an edge
    means), the field that must be set for it to act (only_with: left at its default otherwise),
    and whether a resumed run may change it (resumable; checkpoint.resumable).
    check_fields checks them."""
    meta = dict(help=help, low=low, above=above, high=high, below=below, note=note, only_with=only_with,
                resumable=resumable)
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


def bounds(meta):
    """A field's bounds as a reader writes them: ">= 1", "> 0", "in [0, 1)", ...; None without any."""
    lo = f"[{meta['low']}" if meta["low"] is not None else f"({meta['above']}" if meta["above"] is not None else ""
    hi = f"{meta['high']}]" if meta["high"] is not None else f"{meta['below']})" if meta["below"] is not None else ""
    if lo and hi:
        return f"in {lo}, {hi}"
    return (f"{'>=' if lo[0] == '[' else '>'} {lo[1:]}" if lo
            else f"{'<=' if hi[-1] == ']' else '<'} {hi[:-1]}" if hi else None)


def in_bounds(value, meta):
    low, above, high, below = (meta[k] for k in ("low", "above", "high", "below"))
    return value is None or ((low is None or value >= low) and (above is None or value > above)
                             and (high is None or value <= high) and (below is None or value < below))


def default(cfg, name):
    """The default value of cfg's field `name` (cfg: a Config or the class)."""
    f = cfg.__dataclass_fields__[name]
    return f.default_factory() if f.default_factory is not MISSING else f.default


def check_fields(cfg, named):
    """Refuse a field that fails alone: a float that is not finite, a value its Literal does not list, a
    value out of its bounds; then fields set away from their default while the field they act with
    (only_with) is not set. `named` says in words what an only_with property stands for."""
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        if f.type is float and not math.isfinite(value):  # nan passes every < and > below
            raise ValueError(f"{f.name}={value} must be a finite number")
        if get_origin(f.type) is Literal and value not in get_args(f.type):
            raise ValueError(f"{f.name}={value!r} is not one of {', '.join(get_args(f.type))}")
        if not in_bounds(value, f.metadata):  # the field's bounds (option)
            raise ValueError(f"{f.name}={value} must be {bounds(f.metadata)}{f.metadata['note']}")
    idle = {}  # fields set away from their default while the field they act with is not set
    for f in fields(cfg):
        if (w := f.metadata["only_with"]) and not getattr(cfg, w) and getattr(cfg, f.name) != default(cfg, f.name):
            idle.setdefault(w, []).append(f.name)
    for w, names in idle.items():
        w = named.get(w, w)
        raise ValueError(f"{', '.join(names)} act only with {w} set: set {w}, or leave them at their defaults")
