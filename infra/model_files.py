"""The model's files: model_name_or_path found before anything loads it (a local directory, or a hub
model id the hub can send), its tokenizer, its config.json, and the token ids that end a generation
(the tokenizer's EOS and generation_config.json's eos_token_id). An error here names its fix.

Used by: train.py (locate_model, load_tokenizer, load_model_config); generator.py (stop_token_ids, sent
with every vLLM request); episodes.completion_text (what a turn's text ends before).
"""

import functools
import os


def locate_model(name, timeout=5.0):
    """Refuse, in seconds, a model_name_or_path that cannot load: not a local directory, and not a hub
    model id the hub can send. Otherwise transformers takes it for a hub id and, with the hub out of
    reach, retries for about a minute before it fails (each load again). A hub that cannot be reached
    with the model in the local hub cache: offline mode, so every load reads the cache at once."""
    if os.path.isdir(name):
        return
    import urllib.error
    import urllib.request

    from huggingface_hub import constants, try_to_load_from_cache
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    fix = (f"pass a local model directory (.venv/bin/python scripts/make_tiny_model.py --out {name} builds a tiny "
           "one there), or a hub model id where the hub is reachable")
    try:
        validate_repo_id(name)
    except HFValidationError:
        raise ValueError(f"model_name_or_path={name!r} is not a local directory, nor a hub model id; {fix}") from None
    if constants.HF_HUB_OFFLINE:  # transformers then reads only the cache, and fails fast
        return
    try:
        urllib.request.urlopen(urllib.request.Request(constants.ENDPOINT, method="HEAD"), timeout=timeout).close()
        return
    except urllib.error.HTTPError:  # it answered: transformers fetches the model, or says why not
        return
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
    if isinstance(try_to_load_from_cache(name, "config.json"), str):
        constants.HF_HUB_OFFLINE = True  # read by huggingface_hub at each request; the variable for child processes
        os.environ["HF_HUB_OFFLINE"] = "1"
        return
    raise ValueError(f"model_name_or_path={name!r} is not a local directory, and the hub that would send it as a "
                     f"model id ({constants.ENDPOINT}) cannot be reached ({reason}); {fix}")


def load_tokenizer(cfg):
    """The tokenizer of model_name_or_path, with a one-line error naming the fix."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(cfg.model_name_or_path)
    except (OSError, ValueError) as e:
        where = "is not a local model directory" if not os.path.isdir(cfg.model_name_or_path) else "is unreadable"
        raise ValueError(f"model_name_or_path={cfg.model_name_or_path!r} {where} and could not be loaded "
                         f"({type(e).__name__}); build a tiny model with "
                         f".venv/bin/python scripts/make_tiny_model.py --out {cfg.model_name_or_path}") from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model_config(cfg):
    """model_name_or_path's config.json (transformers' AutoConfig), with a one-line error naming the fix."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(cfg.model_name_or_path)
    except (OSError, ValueError) as e:
        raise ValueError(f"model_name_or_path={cfg.model_name_or_path!r} has no readable config.json "
                         f"({type(e).__name__}); pass a Hugging Face model directory or hub name") from None


@functools.lru_cache
def generation_eos_ids(model_dir) -> tuple:
    """generation_config.json's eos_token_id (an int or a list) of model_dir; () without one."""
    from transformers import GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
    except (OSError, ValueError):
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else () if eos is None else (eos,)


def stop_token_ids(tokenizer, model_dir) -> list:
    """Every token id that ends a generation: the tokenizer's EOS and generation_config.json's eos_token_id
    list, which vLLM also stops on (Llama-3.1-Instruct lists <|end_of_text|>, <|eom_id|> and <|eot_id|>)."""
    ids = {tokenizer.eos_token_id, *generation_eos_ids(model_dir)}
    return sorted(i for i in ids if i is not None)
