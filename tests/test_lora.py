"""LoRA (lora/): what trains, the reference without a copy, the adapter's files and the merge, the
config's refusals (in the test process, no process group); then, slow, real runs on a real vLLM CPU
server serving the adapter: the sync check each step, resume after SIGKILL (a server you run) and after
SIGTERM (the server train.py launches), the exports. The gradients: tests/test_lora_gradients.py."""

import dataclasses
import os
import signal
import sys
import types

import pytest
import torch

from infra import vllm_server
from infra import weight_sync
from lora import adapters
from lora import sync as lora_sync
from config import Config
from infra.policy import sequence_logprobs
from update import dropout, make_optimizer
from helpers import EAGER, command, flags, full, lora_model, metrics, run, serve, served_weights, stable, start, wait_for_step

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def logprobs(model, ids):
    mask = torch.ones(1, ids.shape[1] - 1, dtype=torch.bool)
    return model.sequence_logprobs(ids, mask, 1.0, position_ids=torch.arange(ids.shape[1])[None])[0]


IDS = torch.tensor([[5, 17, 30, 9, 44, 12, 3, 27, 51, 8]])


def test_only_the_adapter_trains_and_the_reference_adapter_starts_at_it(tiny_model_dir):
    cfg, model = lora_model(tiny_model_dir)
    trained = dict(adapters.adapter_parameters(model, adapters.ADAPTER))
    ref = adapters.adapter_parameters(model, adapters.REFERENCE)
    assert trained and len(ref) == len(trained)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == set(trained)
    optimizer, _ = make_optimizer(cfg, model, 10, torch.device("cpu"))
    assert sum(p.numel() for g in optimizer.param_groups for p in g["params"]) == \
        sum(p.numel() for p in trained.values())
    # before lora_model drew lora_B away from 0 the two adapters were equal; lora_A still is
    for name, p in ref:
        if ".lora_A." in name:
            assert torch.equal(p, trained[name.replace(".reference.", ".default.")]), name
    # every linear layer but the LM head has one (all-linear), on q, k, v, o, gate, up, down
    assert sum(".lora_A.default." in n for n in trained) == 7 * model.config.num_hidden_layers


def test_the_fixed_reference_is_the_base_model_bit_for_bit(tiny_model_dir):
    """With the adapters switched off the policy's module computes the base model's logprobs exactly;
    with them on it does not, and afterwards the trained adapter is active again."""
    from transformers import AutoModelForCausalLM

    _, model = lora_model(tiny_model_dir)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    base.sequence_logprobs = types.MethodType(sequence_logprobs, base)
    with torch.no_grad():
        expected, adapted = logprobs(base, IDS), logprobs(model, IDS)
        reference = logprobs(adapters.WithAdapter(model, None), IDS)
        after = logprobs(model, IDS)
        ema = logprobs(adapters.WithAdapter(model, adapters.REFERENCE), IDS)
    assert torch.equal(reference, expected)
    assert (adapted - expected).abs().max() > 1e-3 and torch.equal(after, adapted)
    assert (ema - adapted).abs().max() > 1e-3  # the reference adapter is another adapter


def test_train_builds_the_reference_from_the_adapters(tiny_model_dir):
    """reference.make_reference with LoRA: the EMA reference's forward is the reference adapter's, its
    update moves that adapter alpha of the way to the trained one (and nothing else), and the
    fixed reference is the base."""
    from reference import make_reference

    cfg, model = lora_model(tiny_model_dir)  # lora_B of the trained adapter away from 0, the reference's at 0
    ref = make_reference(cfg, model, None)
    with torch.no_grad():
        with adapters.active(model, adapters.REFERENCE):
            want = logprobs(model, IDS)
        got, trained = logprobs(ref.model, IDS), logprobs(model, IDS)
        assert torch.equal(got, want) and (got - trained).abs().max() > 1e-3
        before = {n: p.clone() for n, p in adapters.adapter_parameters(model, adapters.REFERENCE)}
        pol = {n: p.clone() for n, p in adapters.adapter_parameters(model, adapters.ADAPTER)}
        ref.update()
        for name, p in adapters.adapter_parameters(model, adapters.REFERENCE):
            target = pol[name.replace(f".{adapters.REFERENCE}.", f".{adapters.ADAPTER}.")]
            assert torch.allclose(p, before[name] + cfg.alpha * (target - before[name]), atol=1e-7), name
        assert all(torch.equal(p, pol[n]) for n, p in adapters.adapter_parameters(model, adapters.ADAPTER))
        fixed = make_reference(dataclasses.replace(cfg, ref_policy_update_freq=None), model, None)
        with adapters.active(model, None):
            base = logprobs(model, IDS)
        assert torch.equal(logprobs(fixed.model, IDS), base)


def test_merge_and_the_adapter_directory_give_the_adapters_forward(tiny_model_dir, tmp_path):
    """The merged state dict in a plain model, and PEFT loading the adapter directory we write onto the
    base, compute what the adapted module computes."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cfg, model = lora_model(tiny_model_dir)
    sd = model.state_dict()
    merged = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    merged.load_state_dict(lora_sync.merge(sd, cfg))  # strict: exactly the base's names
    adapter = {lora_sync.peft_key(k): v for k, v in sd.items() if adapters.is_adapter(k, adapters.ADAPTER)}
    lora_sync.write_adapter(adapter, cfg, str(tmp_path / "adapter"))
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32),
                                     str(tmp_path / "adapter"))
    with torch.no_grad():
        want = model(input_ids=IDS).logits
        assert (want - merged(input_ids=IDS).logits).abs().max() < 1e-5
        assert torch.equal(peft(input_ids=IDS).logits, want)
        assert (want - AutoModelForCausalLM.from_pretrained(tiny_model_dir)(input_ids=IDS).logits).abs().max() > 1e-3


def test_a_merged_sync_of_a_tied_model_writes_an_untied_copy(tied_model_dir, tmp_path):
    """lora_weight_sync='merged' on a tied model in a world of one (the head is the embedding's
    storage): the files hold the merged weights, lm_head.weight equal to the embedding, apart."""
    cfg, model = lora_model(tied_model_dir, lora_weight_sync="merged")
    sync = lora_sync.make_weight_sync(cfg, types.SimpleNamespace(proc=None), 0)
    sync.dir = str(tmp_path)
    weight_sync.write_weights(sync.parts(model, []), sync.dir)
    served, want = served_weights(sync.dir), lora_sync.merge(model.state_dict(), cfg)
    assert served.keys() == want.keys() and all(torch.equal(served[k], want[k]) for k in want)
    assert torch.equal(served["lm_head.weight"], served["model.embed_tokens.weight"])


def test_lora_dropout_acts_only_inside_the_gradient_forward(tiny_model_dir):
    _, model = lora_model(tiny_model_dir, lora_dropout=0.5)
    with torch.no_grad():
        plain = logprobs(model, IDS)
        with dropout(model, True):
            dropped = logprobs(model, IDS)
        assert (dropped - plain).abs().max() > 1e-4
        assert torch.equal(logprobs(model, IDS), plain)
    assert not any(m.training for m in model.modules())  # nothing else was ever switched to train mode


@pytest.mark.parametrize("overrides,fragment", [
    (dict(lora_alpha=8.0), "lora_alpha act only with lora_rank set"),
    (dict(lora_rank=-1), "lora_rank=-1 must be >= 0 (0: no LoRA)"),
    (dict(lora_rank=1024), "above vLLM's largest max_lora_rank"),
    (dict(lora_rank=8, lora_dropout=1.0), "lora_dropout=1.0 must be in [0, 1)"),
    (dict(lora_rank=8, lora_dropout=0.1, use_vllm_logprobs=True), "no dropout-free trainer"),
    (dict(lora_rank=8, weight_sync_transport="nccl"), "set weight_sync_transport='filesystem'"),
    (dict(lora_rank=8, beta=0.1, offload_ref_policy=True), "no separate model to offload"),
    (dict(lora_rank=8, lora_target_modules=[]), "lora_target_modules is empty"),
])
def test_config_refuses_what_does_not_make_sense_with_lora(overrides, fragment):
    with pytest.raises(ValueError) as e:
        Config(**overrides)
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_a_target_module_the_model_lacks_is_refused_before_anything_starts(tiny_model_dir):
    from transformers import AutoConfig

    from infra.policy import check_model_config

    cfg = Config(model_name_or_path=tiny_model_dir, lora_rank=4, lora_target_modules=["q_proj", "qkv_proj"])
    with pytest.raises(ValueError, match="has no module named qkv_proj") as e:
        adapters.check(check_model_config(AutoConfig.from_pretrained(tiny_model_dir)), cfg)
    assert "\n" not in str(e.value)
    adapters.check(check_model_config(AutoConfig.from_pretrained(tiny_model_dir)),
               dataclasses.replace(cfg, lora_target_modules=["q_proj"]))


def test_all_linear_adapts_the_decoder_layers_alone(tiny_model_dir, tied_model_dir):
    """PEFT's all-linear leaves out the output layer (get_output_embeddings), tied or not: every adapted
    module is a linear layer inside model.model.layers."""
    from peft.tuners.lora import Linear

    for model_dir in (tiny_model_dir, tied_model_dir):
        _, model = lora_model(model_dir)
        inside = {id(m) for m in model.model.layers.modules()}
        layers = adapters.tuner_layers(model)
        assert len(layers) == 7 * model.config.num_hidden_layers
        assert all(isinstance(m, Linear) and id(m) in inside for m in layers)
        assert not any(".lora_" in n for n, _ in model.lm_head.named_parameters())


@pytest.mark.parametrize("targets", [["lm_head"], ["q_proj", "embed_tokens"], ["model.embed_tokens", "v_proj"]])
def test_adapters_outside_the_decoder_layers_are_refused_before_anything_starts(tiny_model_dir, targets):
    """The LM head and the embeddings take no adapter: sequence_logprobs reads lm_head.weight itself (its
    adapter would get no gradient), and the merge and PEFT's adapter file hold linear layers' lora_A and
    lora_B only (an embedding's adapter would be dropped from both). Refused on the meta model."""
    from transformers import AutoConfig

    from infra.policy import check_model_config

    cfg = Config(model_name_or_path=tiny_model_dir, lora_rank=4, lora_target_modules=targets)
    with pytest.raises(ValueError) as e:
        adapters.check(check_model_config(AutoConfig.from_pretrained(tiny_model_dir)), cfg)
    message = str(e.value)
    assert message.startswith("lora_target_modules=") and "decoder layers" in message and "\n" not in message
    assert "all-linear" in message  # the fix


def test_the_server_we_launch_starts_from_the_base_when_it_loads_the_adapter(tiny_model_dir, tmp_path, monkeypatch):
    """lora_weight_sync='adapter': the launched server's model directory holds the base weights, since
    every sync loads the adapter on top; merged weights there would put it in twice (W + 2 s B A, once
    lora_B has moved: after a resume). 'merged': the merged weights. The server is not started."""
    from transformers import AutoModelForCausalLM

    import train
    from episodes import Completions
    from infra import generator
    from infra.model_files import load_tokenizer

    class Launched(Exception):
        pass

    def launch(model_dir, *args, **kwargs):
        raise Launched(model_dir)
    monkeypatch.setattr(vllm_server, "launch_server", launch)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).state_dict()
    for sync in ("adapter", "merged"):
        cfg, model = lora_model(tiny_model_dir, output_dir=str(tmp_path / sync), lora_weight_sync=sync)
        with pytest.raises(Launched):
            tok = load_tokenizer(cfg)
            generator.Generator(cfg, model, tok, 0, torch.device("cpu"), None, train.make_sync(cfg),
                                types.SimpleNamespace(position=0), Completions(cfg, tok))
        served = served_weights(str(tmp_path / sync / "vllm_model"))
        want = base if sync == "adapter" else lora_sync.merge(model.state_dict(), cfg)
        assert served.keys() == want.keys(), sync
        changed = [k for k in want if not torch.equal(served[k], want[k])]
        assert not changed, f"{sync}: {len(changed)} tensors differ, e.g. {changed[0]}"
        assert all(torch.equal(served[k], base[k]) for k in base) == (sync == "adapter")  # lora_B != 0: merged != base


# --- real runs: train.py with a vLLM CPU server serving the adapter


@pytest.fixture(scope="module")
def lora_server(tiny_model_dir, tmp_path_factory):
    """A server "the user runs", started with LoRA enabled (lora_sync.server_flags)."""
    _, client = serve(tiny_model_dir, str(tmp_path_factory.mktemp("lora_server")), 8056,
                      cfg=Config(model_name_or_path=tiny_model_dir, lora_rank=8))
    yield client
    vllm_server.stop_server(client.proc)


@pytest.mark.slow
def test_sigkill_then_resume_with_lora_equals_the_uninterrupted_run(lora_server, tiny_model_dir, tmp_path):
    """2 ranks, LoRA with the EMA reference adapter, a server serving each step's adapter: the
    server's logprobs agree with the trainer's at every step; a run killed after its step-3
    checkpoint resumes to the same metrics and the same adapters, optimizer and reference adapter,
    bit for bit; the checkpoint holds the adapters alone; the exports load."""
    url, lora_flags = lora_server.urls[0], ["--lora_rank", "8", "--checkpoint_state_freq", "3", "--eval_freq", "0"]
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    out = run(command("train.py", 2) + flags(tiny_model_dir, whole, 6, *lora_flags, url=url))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "trainable parameters" in out.stdout
    # killed as step 5 begins (every rank SIGKILLs itself: a kill from outside could come after step 6)
    out = run(command("tests/fault_worker.py", 2) + ["kill_at_step=5"] + flags(tiny_model_dir, cut, 6, *lora_flags,
                                                                               url=url))
    assert out.returncode != 0 and [r["step"] for r in metrics(cut)] == [1, 2, 3, 4], out.stdout[-2000:]
    assert os.listdir(cut / "ckpt") == ["step_00000003"]
    out = run(command("train.py", 2) + flags(tiny_model_dir, cut, 6, *lora_flags, url=url))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "step_00000003 (step 3)" in out.stdout, out.stdout[-2000:]
    a, b = metrics(whole), metrics(cut)
    assert [r["step"] for r in b] == list(range(1, 7)) and stable(a) == stable(b)
    assert all(r["vllm_logp_diff_max"] < 1e-4 for r in a), [r["vllm_logp_diff_max"] for r in a]
    wa, wb = full(whole / "ckpt" / "step_00000006"), full(cut / "ckpt" / "step_00000006")
    assert wa["policy"] and all(".lora_" in k for k in wa["policy"]) and "ref" not in wa
    for part in ("policy", "optimizer"):
        assert repr(wa[part].keys()) == repr(wb[part].keys())
    assert all(torch.equal(wa["policy"][k], wb["policy"][k]) for k in wa["policy"])
    check_exports(whole / "out", tiny_model_dir)


@pytest.mark.slow
def test_resume_with_the_server_we_launch_loads_the_adapter_once(tiny_model_dir, tmp_path):
    """One process, the server train.py launches, adapter sync, learning_rate 1e-2: a run stopped by
    SIGTERM (a checkpoint of the step it was in) resumes with lora_B far from 0. The resumed run's
    server starts from the base and loads the adapter once (a merged start would serve W + 2 s B A and
    the first step's sync check would stop the run): the check holds at every step, and the run equals
    the uninterrupted one, metrics and adapters bit for bit."""
    lora_flags = ["--lora_rank", "8", "--learning_rate", "1e-2", "--checkpoint_state_freq", "100"]
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    out = run(command("train.py", 1) + flags(tiny_model_dir, whole, 6, *lora_flags))
    assert out.returncode == 0, out.stderr[-3000:]
    proc = start(command("train.py", 1) + flags(tiny_model_dir, cut, 6, *lora_flags))
    wait_for_step(proc, cut, 2)
    proc.send_signal(signal.SIGTERM)
    text = proc.communicate(timeout=300)[0]
    stopped = metrics(cut)[-1]["step"]
    assert proc.returncode == 143 and 2 <= stopped < 6, text[-3000:]
    saved = full(cut / "ckpt" / f"step_{stopped:08d}")["policy"]
    assert min(saved[k].abs().max() for k in saved if ".lora_B.default." in k) > 1e-3  # the adapter has moved
    out = run(command("train.py", 1) + flags(tiny_model_dir, cut, 6, *lora_flags))
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"step_{stopped:08d} (step {stopped})" in out.stdout, out.stdout[-2000:]
    a, b = metrics(whole), metrics(cut)
    assert [r["step"] for r in b] == list(range(1, 7)) and stable(a) == stable(b)
    assert all(r["vllm_logp_diff_max"] < 1e-4 for r in b), [r["vllm_logp_diff_max"] for r in b]
    wa, wb = full(whole / "ckpt" / "step_00000006"), full(cut / "ckpt" / "step_00000006")
    assert wa["policy"].keys() == wb["policy"].keys()
    assert all(torch.equal(wa["policy"][k], wb["policy"][k]) for k in wa["policy"])


def check_exports(out_dir, base_dir):
    """output_dir/final (the adapter merged in) loads in transformers; PEFT's adapter directory on the
    base computes the same logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(out_dir / "final")
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), str(out_dir / "final_adapter"))
    base = AutoModelForCausalLM.from_pretrained(base_dir)
    with torch.no_grad():
        want = peft(input_ids=IDS).logits
        assert (merged(input_ids=IDS).logits - want).abs().max() < 1e-4
        assert (base(input_ids=IDS).logits - want).abs().max() > 1e-4  # the adapter trained


@pytest.mark.slow
@pytest.mark.parametrize("extra", [["--lora_dropout", "0.1"], ["--lora_weight_sync", "merged"]],
                         ids=["adapter-dropout", "merged"])
def test_a_server_we_launch_takes_the_adapter_or_the_merged_weights(extra, tiny_model_dir, tmp_path):
    """One process and the server train.py launches: with LoRA enabled (and lora_dropout, whose
    sync check reads the dropout-free logprobs), or without LoRA, given merged weights. The sync
    check holds at every step, the run learns nothing wrong, and its exports load."""
    out = run([sys.executable, os.path.join(ROOT, "train.py"), "--model_name_or_path", tiny_model_dir, "--output_dir",
               str(tmp_path / "out"), "--num_training_steps", "4", "--eval_freq", "0", "--beta", "0.1",
               "--lora_rank", "8", "--learning_rate", "1e-2", *EAGER, *extra])
    assert out.returncode == 0, out.stderr[-3000:]
    rows = metrics(tmp_path)
    assert len(rows) == 4 and all(r["vllm_logp_diff_max"] < 1e-4 for r in rows), rows
    log = open(tmp_path / "out" / "vllm.log").read()
    assert ("Loaded new LoRA adapter" in log) == ("merged" not in extra)
    check_exports(tmp_path / "out", tiny_model_dir)
