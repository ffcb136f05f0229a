"""The NCCL weight sync (weight_sync_transport="nccl"): the trainer's weights into GPU vLLM servers
through vLLM's native weight-transfer API, in the server's dtype (vllm_server.server_dtype).

    sync = NCCLSync(client, rank, master_address, master_port, device, timeout, dtype)
    sync.sync(policy)                      # every rank: every gather first, then rank 0 sends

Optional: `rm nccl_sync.py` leaves a trainer whose filesystem sync (infra/weight_sync.py) is whole.
Its one door is train.py:make_sync. Its NCCL calls are untested on the CPU machines this project is
built on; its error path is tested with the server faked, and its two halves of vLLM's contract (the
WeightSource, the client) against the pinned vLLM's own classes (tests/test_nccl_sync.py).

The contract is vLLM 0.32's (vllm/distributed/weight_transfer/base.py), the release pyproject.toml
pins (infra/vllm_server.py VLLM_VERSION): a WeightSource with a `metadata()` method and `__iter__`,
and a client of four methods (VLLMWeightSyncClient) that NCCLTrainerWeightTransferEngine drives.
vLLM 0.33 changed it: `metadata` must be a functools.cached_property (a method is a TypeError when
the class is made) and the broadcast reads `iter_full()`. The pin keeps us on 0.32's.

The transfer, which would otherwise wait forever for a peer that is gone, runs in a thread that is
abandoned with a TimeoutError past weight_sync_timeout (within).
"""

import math
import threading

import torch

from infra.weight_sync import failure, full_state_dict, raise_on_every_rank, serving_parts


class NCCLSync:
    """GPU servers: vLLM's native weight-transfer API over NCCL (server launched with
    --weight-transfer-config '{"backend": "nccl"}'). The NCCL calls are untested on the CPU
    machines this project is developed on (tests/test_nccl_sync.py fakes the server's HTTP side).
    Every rank gathers the weights tensor by tensor, in the same order (each full_tensor() is a
    collective): a rank holds one full float32 tensor on its device at a time, and rank 0 keeps
    each one cast to the server's dtype in CPU memory. Only then does rank 0 send, one tensor at a
    time back on its GPU into vLLM's packed buffers: a gather interleaved with the broadcast would
    leave the other ranks waiting inside a gather that rank 0, stuck in a failed transfer, never
    joins. Supports one server with one worker (tensor parallel size 1)."""

    server_flags, sync_at_start = (), False  # its server's --weight-transfer-config is server_command's

    def __init__(self, client, rank, master_address, master_port, device, timeout, dtype=torch.bfloat16):
        self.client, self.rank, self.device, self.engine, self.timeout = client, rank, device, None, timeout
        self.master_address, self.master_port = master_address, master_port  # this trainer's rendezvous
        self.dtype = dtype  # the server's: a bfloat16 copy of float32 weights in a float32 server fails the check

    def launch_state_dict(self, model):
        return full_state_dict(model)

    # the four calls vLLM's trainer engine makes on its client (VLLMWeightSyncClient), sent as vLLM's own
    # HTTPVLLMWeightSyncClient sends them (the two that wait for the NCCL transfer get weight_sync_timeout,
    # not the request timeout)
    def init_weight_transfer_engine(self, init_info):
        self.client.broadcast("/init_weight_transfer_engine", {"init_info": init_info}, timeout=self.timeout)

    def start_weight_update(self):
        self.client.broadcast("/start_weight_update")

    def update_weights(self, update_info):
        self.client.broadcast("/update_weights", {"update_info": update_info}, timeout=self.timeout)

    def finish_weight_update(self, weight_version=None):
        self.client.broadcast("/finish_weight_update", None if weight_version is None else
                              {"weight_version": weight_version})

    def gather(self, model):
        """Every rank: the serving copy's tensors, in the server's dtype and CPU memory, on rank 0
        (empty on the others). On the device first: offloaded (offload_params) shards are in CPU
        memory, and NCCL gathers GPU tensors."""
        return next(serving_parts(model, self.rank, math.inf, self.dtype, self.device), {})

    def sync(self, model):
        """Returns the bytes sent (rank 0) or 0. A failed transfer (an HTTP error, a timeout, an
        NCCL error) raises VLLMError on every rank, so all can save a checkpoint first; unless a
        server we launched died: then the next rollout restarts it and pushes the weights again."""
        full = self.gather(model)  # every gather on every rank before any send
        nbytes, error = 0, None
        if self.rank == 0:
            try:
                nbytes = self.send(full)
            except Exception as e:  # noqa: BLE001 -- whatever it was, every rank must hear of it
                error = failure(self.client, e)
                self.close()  # its NCCL group is unusable: vLLM leaves the tear-down to the caller
        del full
        raise_on_every_rank(error)
        return nbytes

    def send(self, full):
        """Rank 0: the gathered tensors into the server over NCCL."""
        from vllm.distributed.weight_transfer.nccl_engine import (NCCLTrainerInitInfo,
                                                                   NCCLTrainerWeightTransferEngine)
        source = gathered_source(full, self.device)
        with self.client.updating():  # in-flight generations finish on the old weights; new ones wait
            self.client.pause()
            try:
                if self.engine is None:
                    info = NCCLTrainerInitInfo(master_address=self.master_address, master_port=self.master_port,
                                               world_size=2, rank=0)
                    self.engine = within(self.timeout, lambda: NCCLTrainerWeightTransferEngine.trainer_init(
                        info, client=self, source=source), "the NCCL rendezvous with the vLLM server", self.device)
                self.engine.source = source  # send_weights replays the engine's source: this round's tensors
                within(self.timeout, self.engine.send_weights, "the NCCL weight transfer", self.device)
            finally:
                self.client.resume()
            self.client.reset_prefix_cache()
        return sum(v.numel() * v.element_size() for v in full.values())

    def close(self):
        engine, self.engine = self.engine, None
        if engine is not None:
            try:  # a failed engine may hang or raise on the way down: neither may hide the first error
                within(self.timeout, engine.shutdown, "shutting down the NCCL weight-transfer engine")
            except Exception as e:  # noqa: BLE001
                print(f"weight sync: the NCCL engine did not shut down cleanly: {e}", flush=True)


def gathered_source(full, device):
    """vLLM 0.32's WeightSource over rank 0's gathered tensors: `metadata()` declares each one (name,
    dtype, shape) without moving it, and each pass (`__iter__`, fresh every time) yields them in the
    same order, one at a time on `device`, where vLLM copies each into its packed buffers. vLLM is
    imported here, on rank 0 of an NCCL sync only."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class Gathered(WeightSource):
        def metadata(self):
            return [ParamMeta(k, v.dtype, tuple(v.shape)) for k, v in full.items()]

        def __iter__(self):
            return ((k, v.to(device)) for k, v in full.items())

    return Gathered()


def within(seconds, fn, what, device=None):
    """fn() in a daemon thread, given up after `seconds` with a TimeoutError: an NCCL call
    whose peer has gone waits forever, and NCCL takes no timeout of its own. The stuck
    thread cannot be stopped; the error ends the run (a daemon thread does not hold exit)."""
    out = {}

    def run():
        try:
            if device is not None and device.type == "cuda":
                torch.cuda.set_device(device)  # the current device is per thread
            out["value"] = fn()
        except BaseException as e:  # handed to the caller's thread
            out["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise TimeoutError(f"weight sync: {what} did not finish within weight_sync_timeout={seconds:g}s; the server "
                           "may be stuck or gone (see its log). Raise weight_sync_timeout if the transfer is only slow")
    if "error" in out:
        raise out["error"]
    return out.get("value")
