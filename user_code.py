"""Code a user names by flag, as `module:name` or `path/to/file.py:name`: a reward (--reward_fn),
an environment (--environment), an agent (--agent), an objective (--loss_fn). load_object loads it
and names the flag in every error; objective looks a loss_fn up in loss.OBJECTIVES or loads the
user's row and checks it, so that loss.py stays pure functions.
"""

import functools
import importlib
import importlib.util
import inspect
import os


def load_object(path, flag="reward_fn", kind="function"):
    """`module:name` (importable) or `path/to/file.py:name`; errors name the flag it came from."""
    module_name, sep, name = path.rpartition(":")
    if not sep or not module_name or not name:
        raise ValueError(f"{flag}={path!r} must look like 'module:{kind}' or 'file.py:{kind}'")
    if module_name.endswith(".py") and not os.path.isfile(module_name):
        raise ValueError(f"{flag} file {module_name!r} does not exist; give a path to a .py file")
    try:
        if module_name.endswith(".py"):
            spec = importlib.util.spec_from_file_location(f"user_{flag}", module_name)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{flag}={path!r}: cannot import {module_name!r} ({e}); check the module path") from None
    except Exception as e:  # noqa: BLE001 - a SyntaxError, or whatever the file raises when it runs
        where = f" (line {e.lineno})" if isinstance(e, SyntaxError) and e.lineno else ""
        raise ValueError(f"{flag}={path!r}: {module_name!r} does not load: {type(e).__name__}{where}: "
                         f"{getattr(e, 'msg', e)}; fix the file") from None
    obj = getattr(module, name, None)
    if obj is None:
        raise ValueError(f"{flag}={path!r}: {module_name!r} has no {kind} {name!r}")
    return obj


def objective(loss_fn):
    """Config.objective: loss_fn's row: a name of OBJECTIVES, or "file.py:name" / "module:name" naming an Objective of
    your own (nothing in this file to edit); None for an unknown name. ValueError naming the fix."""
    from loss import OBJECTIVES  # noqa: PLC0415 - here, not above: reward workers load user files without torch
    return OBJECTIVES.get(loss_fn) if ":" not in loss_fn else objective_of_your_own(loss_fn)


@functools.cache  # its file runs once per process and spec
def objective_of_your_own(loss_fn):
    """The row loss_fn names, checked before anything starts: an Objective, clip fields that exist,
    and a function that takes what grpo_loss will pass it."""
    from loss import Objective  # noqa: PLC0415

    row = load_object(loss_fn, flag="loss_fn", kind="Objective")
    if not isinstance(row, Objective):
        raise ValueError(f"loss_fn={loss_fn!r} is not a loss.Objective but {type(row).__name__!r}; name a row such "
                         "as Objective(my_loss, clip=(...)) in that file")
    if unknown := set(row.clip) - {"clip_lower", "clip_higher"}:
        raise ValueError(f"loss_fn={loss_fn!r}: clip names {', '.join(sorted(unknown))}; the clip fields are "
                         "clip_lower and clip_higher")
    needs = {k: None for k, wanted in (("seq_ids", row.sequences), ("ess_value", row.ess)) if wanted}
    try:
        inspect.signature(row.fn).bind(None, None, None, None, **needs)
    except (TypeError, ValueError) as e:
        raise ValueError(f"loss_fn={loss_fn!r}: its function cannot take (logp, old_logp, adv, cfg"
                         + "".join(f", {k}=" for k in needs) + f") ({e}); fix its signature or its row") from None
    return row
