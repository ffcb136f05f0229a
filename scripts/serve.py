"""Become the vLLM server train.py would launch, for a server you run (scripts/launch_8gpu.sh).

    python scripts/serve.py --serve serving/qwen0.5b --vllm_port 8000 [train.py's flags]
    python scripts/serve.py --print --serve serving/qwen0.5b ...   # its environment and command, not run

The server's command line is vllm_server.server_command of train.py's flags, on 127.0.0.1:vllm_port,
with LoRA's flags when the adapter is synced (lora/sync.py server_flags, imported only with lora_rank
set): the servers' flags have one source, the trainer's.
"""

import os
import shlex
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from config import Config  # noqa: E402
from infra.cli import fail, parse_args_or_exit  # noqa: E402
from infra.vllm_server import server_command  # noqa: E402


def main(argv=None):
    """python scripts/serve.py [--print] --serve MODEL_DIR [train.py's flags]: this process becomes the
    server on MODEL_DIR (execve: the caller's pid stops it); --print writes its command instead."""
    argv = list(sys.argv[1:] if argv is None else argv)
    show = "--print" in argv
    argv = [a for a in argv if a != "--print"]
    if len(argv) < 2 or argv[0] != "--serve":
        fail("usage: python scripts/serve.py [--print] --serve MODEL_DIR [train.py's --key value flags]")
    cfg = parse_args_or_exit(Config, argv[2:])
    extra = []
    if cfg.lora_rank:
        from lora.sync import server_flags  # noqa: PLC0415 - LoRA's door
        extra = server_flags(cfg)
    cmd, added = server_command(argv[1], cfg, cfg.vllm_port, extra_args=extra)
    if show:
        print(" ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(added.items())), shlex.join(cmd))
        return
    sys.stdout.flush()
    os.execve(cmd[0], cmd, dict(os.environ, **added))


if __name__ == "__main__":
    main()
