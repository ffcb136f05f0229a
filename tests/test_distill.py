"""On-policy distillation (distill/): the teacher's scores aligned with the trainer's targets token for
token, the objectives against exact enumeration, the refusals, and the teacher's vLLM server against a
forward of the teacher in the trainer."""

import json
import math
import os
import shutil
import sys

import pytest
import torch

from config import Config
from distill import teacher
from episodes import Sample
from helpers import EAGER, command, metrics, run, trainer_logprobs
from loss import grpo_loss, kl_advantage
from packing import collate

V = 9


def log_softmax(seed):
    return torch.log_softmax(torch.randn(V, generator=torch.Generator().manual_seed(seed), dtype=torch.float64), -1)


def exact_kl(theta, ref):
    logpi = torch.log_softmax(theta, -1)
    kl = (logpi.exp() * (logpi - ref)).sum()
    return kl, torch.autograd.grad(kl, theta)[0]


# --- the objectives, by hand and by exact enumeration over a vocabulary of V tokens


def test_kl_advantage_by_hand():
    """A_t = A - beta (old_logp - ref_logp); dapo at ratio 1 gives loss -sum(A_t) / denominator and
    gradient -A_t / denominator; no KL term in the loss, the logged KL is the k1."""
    logp = torch.tensor([-1.0, -2.0, -0.5], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-1.5, -1.0, -0.5], dtype=torch.float64)
    adv = torch.tensor([1.0, 1.0, -0.5], dtype=torch.float64)
    cfg = Config(beta=0.5, kl_estimator="advantage")
    loss, sums = grpo_loss(logp, logp.detach(), adv, torch.tensor([0, 0, 1]), 4.0, cfg, ref_logp=ref)
    # d = (0.5, -1.0, 0.0): A_t = (1 - 0.25, 1 + 0.5, -0.5) = (0.75, 1.5, -0.5)
    assert torch.isclose(loss, torch.tensor(-(0.75 + 1.5 - 0.5) / 4.0, dtype=torch.float64))
    assert torch.allclose(torch.autograd.grad(loss, logp)[0], torch.tensor([-0.75, -1.5, 0.5], dtype=torch.float64) / 4)
    assert torch.isclose(sums["kl"], torch.tensor(-0.5, dtype=torch.float64))
    assert torch.equal(kl_advantage(adv, logp.detach(), ref, 0.5)[1], torch.tensor([0.5, -1.0, 0.0], dtype=torch.float64))


def test_kl_advantage_estimates_the_reverse_kl_in_value_and_gradient():
    """Alone (A = 0), on-policy: E_pi over the sampled token of the loss is beta KL(pi || ref) and of its
    gradient beta grad KL(pi || ref), enumerating every token."""
    theta = torch.randn(V, generator=torch.Generator().manual_seed(0), dtype=torch.float64).requires_grad_()
    ref = log_softmax(1)
    logpi = torch.log_softmax(theta, -1)
    cfg = Config(beta=2.0, kl_estimator="advantage")
    value = 0.0
    for p in range(V):
        one = slice(p, p + 1)
        loss, _ = grpo_loss(logpi[one], logpi[one].detach(), torch.zeros(1, dtype=torch.float64),
                            torch.zeros(1, dtype=torch.long), 1.0, cfg, ref_logp=ref[one])
        value = value + logpi[p].exp().detach() * loss
    (grad,) = torch.autograd.grad(value, theta)
    kl, kl_grad = exact_kl(theta, ref)
    assert torch.allclose(value, 2 * kl, atol=1e-12) and torch.allclose(grad, 2 * kl_grad, atol=1e-12)


@pytest.mark.parametrize("k", [0, 1, 3, V])
def test_topk_kl_over_the_teachers_head_is_unbiased(k):
    """EMA-PG's top-k KL with the head the teacher's server reports, its own top k (not the student's):
    through grpo_loss, E over the sampled token of the value and gradient are the exact reverse KL's."""
    theta = torch.randn(V, generator=torch.Generator().manual_seed(0), dtype=torch.float64).requires_grad_()
    ref = log_softmax(2)
    logpi = torch.log_softmax(theta, -1)
    q = ref.topk(k).indices
    assert k in (0, V) or set(q.tolist()) != set(logpi.detach().topk(k).indices.tolist()), "heads alike test nothing"
    cfg = Config(beta=1.0, kl_estimator="topk")
    value = 0.0
    for p in range(V):
        one = slice(p, p + 1)
        heads = (logpi[q][None], ref[q][None], torch.isin(torch.tensor([p]), q))
        loss, _ = grpo_loss(logpi[one], logpi[one].detach(), torch.zeros(1, dtype=torch.float64),
                            torch.zeros(1, dtype=torch.long), 1.0, cfg, ref_logp=ref[one], kl_heads=heads)
        value = value + logpi[p].exp().detach() * loss
    (grad,) = torch.autograd.grad(value, theta)
    kl, kl_grad = exact_kl(theta, ref)
    assert torch.allclose(value, kl, atol=1e-12) and torch.allclose(grad, kl_grad, atol=1e-12)


@pytest.mark.parametrize("kl_estimator", ["k1", "k2", "k3", "k4", "topk", "topk_forward", "advantage"])
def test_a_teacher_equal_to_the_student_gives_a_kl_of_exactly_zero(kl_estimator):
    """ref_logp equal to the student's logprobs token for token (and its head's): every estimator's value is
    0.0 exactly at every token; k2, k3 and the advantage form (whose gradient is d grad log pi or zero at
    d = 0) then leave the objective's gradient as it is without a KL (k1, k4 and the top-k KL have a
    gradient of expectation 0, not 0 at each token)."""
    logp = torch.tensor([-0.3, -2.0, -1.1, -4.0], requires_grad=True)
    head = torch.log_softmax(torch.randn(4, V, generator=torch.Generator().manual_seed(0)), -1)[:, :3]
    cfg = Config(beta=1.0, kl_estimator=kl_estimator)
    adv, seqs = torch.tensor([1.0, 1.0, -1.0, -1.0]), torch.tensor([0, 0, 1, 1])
    in_head = torch.tensor([True, False, True, False])
    for i in range(4):  # one token at a time: zeros, not a sum that cancels
        heads = (head[i:i + 1], head[i:i + 1].clone(), in_head[i:i + 1]) if kl_estimator.startswith("topk") else None
        one = slice(i, i + 1)
        _, sums = grpo_loss(logp[one], logp[one].detach(), adv[one], seqs[one], 4.0, cfg,
                            ref_logp=logp[one].detach().clone(), kl_heads=heads)
        assert sums["kl"].item() == 0.0
    if kl_estimator in ("k2", "k3", "advantage"):
        loss, _ = grpo_loss(logp, logp.detach(), adv, seqs, 4.0, cfg, ref_logp=logp.detach().clone())
        plain, _ = grpo_loss(logp, logp.detach(), adv, seqs, 4.0, Config())
        assert torch.equal(loss, plain)
        assert torch.equal(torch.autograd.grad(loss, logp)[0], torch.autograd.grad(plain, logp)[0])


# --- the teacher's answers, aligned with the trainer's targets


def encoding(ids, k):
    """What a vLLM server answers for a sequence of token ids (prompt_logprobs), with each logprob encoding
    the token it scores and its position: entry j gives token t at position j the logprob -(t + j / 1000),
    and its top k are the ids t + 1.. t + k (t itself among them when t is even)."""
    entries = [None]
    for j, t in enumerate(ids[1:], 1):
        head = [t] + [t + i for i in range(1, k)] if t % 2 == 0 else [t + i for i in range(1, k + 1)]
        entries.append({str(i): {"logprob": -(i + j / 1000), "rank": 1} for i in (head if k else []) + [t]})
    return entries


def answers_encoding(sample, k):
    """The encoded answers (encoding) for each sequence of `sample`."""
    return [encoding(ids, k) for ids, _, _ in teacher.sequences(sample)]


@pytest.mark.parametrize("k", [0, 3])
def test_the_teachers_scores_land_on_the_trainers_targets(k):
    """Two samples of one prompt (packed with the prompt shared), environment tokens in the second, and an
    agent's episode that restarts: through scores() and packing.collate, the teacher's logprob at each
    loss token is the one vLLM gave that very target at that very position (an off-by-one would read
    the neighbour's), and its head is the one of that position."""
    prompt = [3, 5, 7, 9]
    samples = [Sample(prompt, [11, 12, 13, 14], [0.0] * 4),
               Sample(prompt, [11, 20, 21, 22, 15, 16], [0.0] * 6, mask=[1, 1, 0, 0, 1, 1]),
               Sample([2, 4], [6, 30, 31, 32, 33], [0.0] * 5, mask=[1, 0, 0, 1, 1], restarts=(1,))]
    for s in samples:
        s.ref = teacher.scores(s, answers_encoding(s, k), k)
    b = collate(samples, share=True)
    targets = b["input_ids"][0, 1:][b["mask"][0]]
    positions = b["position_ids"][0, 1:][b["mask"][0]]
    # a restarted sequence's positions start again from 0, as vLLM's do for its own request
    expected = -(targets.double() + positions.double() / 1000)
    assert torch.equal(b["ref_logp"], expected.float())
    if k:
        assert b["ref_head_ids"].shape == (len(targets), k)
        in_head = (b["ref_head_ids"] == targets[:, None]).any(-1)
        assert torch.equal(in_head, targets % 2 == 0)  # the sampled token is in the head exactly when even
        assert (b["ref_head_ids"] != targets[:, None]).all(-1).eq(targets % 2 == 1).all()
        assert torch.equal(b["ref_head_logp"][:, 0], -(b["ref_head_ids"][:, 0].double() + positions / 1000).float())
    else:
        assert "ref_head_ids" not in b


class Encoder:
    """A teacher's server that answers every request with its encoding, and keeps the token ids asked."""
    model = "t"

    def __init__(self, k):
        self.k, self.asked = k, []

    def map(self, route, payloads):
        self.asked += [p["prompt"] for p in payloads]
        return [{"choices": [{"prompt_logprobs": encoding(p["prompt"], self.k)}]} for p in payloads]


@pytest.mark.parametrize("k", [0, 3])
def test_a_teacher_with_a_context_of_its_own_scores_the_students_tokens_at_their_place_in_its_sequence(k):
    """The teacher sees a system prompt the student does not (teacher_context_file): Teacher.prepare asks
    for the teacher's chat rendered by the template and the episode's tokens after the student's prompt,
    and through packing each loss token gets the encoding of its own token at its position in the
    teacher's sequence: the student's position shifted by what the context adds, in the first sequence
    only (a restarted one is the episode's own); the environment's tokens are asked and dropped."""
    from distill.context import Context
    from helpers import family_tokenizer

    tok = family_tokenizer("qwen3")  # no default system prompt: the teacher's is a prefix of its own
    system = [{"role": "system", "content": "Think."}]
    context = Context(tok, system)
    questions = [[{"role": "user", "content": "What is 3 + 4?"}], [{"role": "user", "content": "Hi"}]]
    prompts = [context.ids(q) for q in questions]  # the student's prompt ids, as data.tokenize_rows makes them
    theirs = [context.ids(system + q) for q in questions]  # the teacher's, rendered by the template on its own
    samples = [Sample(prompts[0], [11, 12, 13, 14], [0.0] * 4),
               Sample(prompts[0], [11, 20, 21, 22, 15, 16], [0.0] * 6, mask=[1, 1, 0, 0, 1, 1]),
               Sample(prompts[1], [6, 30, 31, 32, 33], [0.0] * 5, mask=[1, 0, 0, 1, 1], restarts=(1,))]
    ref = teacher.Teacher(Config(teacher_model_name_or_path="t", beta=1.0, kl_estimator="topk" if k else "advantage",
                                 kl_topk=k), rank=1)
    ref.rank, ref.context, ref.client = 0, context, Encoder(k)
    ref.prepare(samples)
    assert ref.client.asked == [theirs[0] + samples[0].token_ids, theirs[0] + samples[1].token_ids,
                                theirs[1] + [6], [30, 31, 32, 33]]
    shifts = [len(t) - len(p) for t, p in zip(theirs, prompts)]
    prefix = tok("<|im_start|>system\nThink.<|im_end|>\n", add_special_tokens=False)["input_ids"]
    assert shifts == [len(prefix)] * 2 and all(t == prefix + p for t, p in zip(theirs, prompts))
    b = collate(samples, share=True)
    targets = b["input_ids"][0, 1:][b["mask"][0]]
    positions = b["position_ids"][0, 1:][b["mask"][0]]  # the student's
    shift = torch.tensor([shifts[0]] * 8 + [shifts[1], 0, 0])  # sample 3's last two after its restart
    expected = -(targets.double() + (positions + shift).double() / 1000)
    assert torch.equal(b["ref_logp"], expected.float())
    if k:
        assert torch.equal(b["ref_head_logp"][:, 0],
                           -(b["ref_head_ids"][:, 0].double() + (positions + shift) / 1000).float())


@pytest.mark.parametrize("family", ["qwen2.5-instruct", "qwen3", "smollm2-instruct", "llama-3.1-instruct"])
def test_the_teachers_prompt_is_the_templates_rendering_of_its_chat(family):
    """Context.prompt on the student's prompt ids against the template's rendering of the teacher's chat (the
    prompt's system message, then the file's messages, then the prompt's turns), for the families' real
    templates: a system prompt, worked examples, both, before prompts with and without a system message."""
    from distill.context import Context
    from helpers import family_tokenizer

    tok = family_tokenizer(family)
    system = [{"role": "system", "content": "You are a careful calculator user."}]
    examples = [{"role": "user", "content": "What is 214 + 659?"},
                {"role": "assistant", "content": "<calc>214 + 659</calc>"}, {"role": "tool", "content": "873"},
                {"role": "assistant", "content": "\\boxed{873}."}]
    for messages in (system, examples, system + examples):
        context = Context(tok, messages)
        context.check("f.json")
        for own in ([], [{"role": "system", "content": "Be brief."}], [{"role": "system", "content": "In words."}]):
            for question in ("Hi", "What is 3 * 4?"):
                row = own + [{"role": "user", "content": question}]
                assert context.prompt(context.ids(row)) == context.ids(own + messages + row[len(own):]), (messages, row)


def test_the_calculator_demos_teacher_sees_the_tools_demos_prompt():
    """scripts/demo.sh --distill-context: the student's prompt is calculator_plain's (the system message and
    the question), and the teacher's, spliced in by examples/calculator_example.json, is token for token the
    prompt of the calculator with its worked example (the tools demo's), in SmolLM2's template."""
    from distill.context import Context, load
    from envs.calculator import calculator, calculator_plain
    from helpers import family_tokenizer

    context = Context(family_tokenizer("smollm2-instruct"), load("examples/calculator_example.json"))
    context.check("examples/calculator_example.json")
    for question in ("What is 348 - 479?", "What is 25 * 61?"):
        row = {"prompt": question}
        student = calculator_plain.reset(row)
        assert [m["role"] for m in student] == ["system", "user"] and student[-1]["content"] == question
        assert context.prompt(context.ids(student)) == context.ids(calculator.reset(row))


HOISTING = ("{% set ns = namespace(s='') %}{% for m in messages %}{% if m.role == 'system' %}"
            "{% set ns.s = ns.s + m.content + '\\n\\n' %}{% else %}<|im_start|>{{ m.role }}\\n"
            "{% if m.role == 'user' %}{{ ns.s }}{% set ns.s = '' %}{% endif %}{{ m.content }}<|im_end|>\\n{% endif %}"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\\n{% endif %}")


def test_a_template_that_moves_the_system_message_into_the_first_user_turn_is_refused_at_start_up():
    """Gemma-like, without raising: a template that writes a system message into the next user turn puts a
    prompt's system message into the first worked example's turn, which no splice at the prompt's user
    turn makes: check refuses it in one line."""
    from distill.context import Context
    from helpers import family_tokenizer

    tok = family_tokenizer("qwen2.5-instruct")
    tok.chat_template = HOISTING
    context = Context(tok, [{"role": "user", "content": "What is 1 + 1?"}, {"role": "assistant", "content": "2"}])
    with pytest.raises(ValueError, match=r"^teacher_context_file='f.json': the chat template of 'qwen2.5-instruct' "
                                         r"renders the file's messages before a prompt with a system message otherwise "
                                         r"than as a splice of the student's prompt; fold"):
        context.check("f.json")


def test_a_teacher_context_file_is_refused_in_one_line_when_it_cannot_be_read(tmp_path, tiny_model_dir):
    from transformers import AutoTokenizer

    from distill import context
    from helpers import family_tokenizer

    with pytest.raises(ValueError, match="^teacher_context_file is what a teacher sees beyond the prompt: set "
                                         "teacher_model_name_or_path too$"):
        Config(teacher_context_file="f.json")
    with pytest.raises(ValueError, match="string prompts without a chat template have none: set "
                                         "apply_chat_template=True"):
        Config(teacher_model_name_or_path="t", beta=1.0, kl_estimator="advantage", teacher_context_file="f.json")
    bad = tmp_path / "bad.json"
    for text, why in (("[{", "does not load"), ("[]", "holds no messages"), ('[{"role": "who", "content": "x"}]',
                                                                            "holds no messages, or one that")):
        bad.write_text(text)
        with pytest.raises(ValueError, match=f"^teacher_context_file=.*{why}"):
            context.load(str(bad))
    (tmp_path / "ok.jsonl").write_text('{"role": "system", "content": "A"}\n\n{"role": "user", "content": "B"}\n')
    assert context.load(str(tmp_path / "ok.jsonl"))[1] == {"role": "user", "content": "B"}
    (tmp_path / "sys.json").write_text('[{"role": "system", "content": "Think."}]')
    cfg = Config(model_name_or_path=tiny_model_dir, teacher_model_name_or_path=tiny_model_dir, beta=1.0,
                 kl_estimator="advantage", teacher_context_file=str(tmp_path / "sys.json"), apply_chat_template=True)
    teacher.check(cfg, AutoTokenizer.from_pretrained(tiny_model_dir), cuda=False)
    with pytest.raises(ValueError, match=r"^teacher_context_file=.*: the chat template of 'gemma-2-it' raises on its "
                                         r"messages \(TemplateError: System role not supported\)"):
        context.checked(family_tokenizer("gemma-2-it"), str(tmp_path / "sys.json"))
    from infra.faults import Refused

    with pytest.raises(Refused, match="no user turn as the chat template opens one"):
        context.Context(family_tokenizer("qwen3"), [{"role": "system", "content": "Think."}]).prompt([5, 6, 7])


def test_the_teachers_head_in_a_micro_batch_of_padding_alone_and_at_k_0():
    """Teacher.logprobs on a micro-batch with no loss token (packing's filler) and with kl_topk=0 (the
    sampled k4, an empty head): (N,) and (N, k) tensors that kl_topk takes, never None."""
    from packing import PADDING

    for k in (0, 3):
        ref = teacher.Teacher(Config(teacher_model_name_or_path="t", beta=1.0, kl_estimator="topk", kl_topk=k), rank=1)
        empty = collate([PADDING])
        logp, _, head, ids = ref.logprobs(None, empty)
        assert logp.shape == (0,) and head.shape == ids.shape == (0, k)
        s = Sample([3, 5], [6, 7], [0.0, 0.0])
        s.ref = teacher.scores(s, answers_encoding(s, k), k)
        logp, _, head, ids = ref.logprobs(None, collate([s]))
        assert logp.shape == (2,) and head.shape == ids.shape == (2, k)


def test_an_answer_not_of_the_form_asked_for_stops_every_rank_as_a_server_failure():
    """A server that answers with no prompt logprobs, or too few: VLLMError (every rank raises it, train.py
    checkpoints and stops), never a KeyError or TypeError on rank 0 alone while the others wait."""
    from infra.faults import VLLMError

    class Answers:  # what a broken server could send back
        model = "t"

        def __init__(self, entries):
            self.entries = entries

        def map(self, route, payloads):
            return [{"choices": [{"prompt_logprobs": self.entries}]} for _ in payloads]

    ref = teacher.Teacher(Config(teacher_model_name_or_path="t", beta=1.0, kl_estimator="advantage"), rank=1)
    ref.rank = 0
    for entries, why in ((None, "TypeError"), ([None, {}], "ValueError: 2 prompt logprobs for a sequence of 4")):
        ref.client = Answers(entries)
        with pytest.raises(VLLMError, match=f"answered what it was not asked \\({why}"):
            ref.prepare([Sample([3, 5], [6, 7], [0.0, 0.0])])


def test_the_teacher_offers_the_whole_seam_of_a_reference():
    """What checkpoint.py, update.py and train.py call on any reference: a teacher moves nothing, and a
    checkpoint holds nothing of it (its server is restarted from the same files)."""
    from reference import Reference

    ref = teacher.Teacher(Config(teacher_model_name_or_path="t", beta=1.0, kl_estimator="advantage"), rank=1)
    seam = {n for n in dir(Reference) if not n.startswith("_")} - {"update"}  # update: step's, when due
    assert seam <= set(dir(ref)), seam - set(dir(ref))
    assert ref.ref_params == () and ref.state_dict() == {}
    ref.step(1)
    ref.load_state_dict({})


# --- refusals


def test_config_refuses_what_a_teacher_cannot_do():
    with pytest.raises(ValueError, match="needs beta > 0"):
        Config(teacher_model_name_or_path="t")
    with pytest.raises(ValueError, match="sample at temperature=1.0"):
        Config(teacher_model_name_or_path="t", beta=1.0, temperature=0.7, kl_estimator="advantage")
    with pytest.raises(ValueError, match="neither moves nor offloads"):
        Config(teacher_model_name_or_path="t", beta=1.0, ref_policy_update_freq=1, kl_estimator="advantage")
    with pytest.raises(ValueError, match="reward_advantage=False trains on the KL term alone"):
        Config(reward_advantage=False, beta=1.0)
    with pytest.raises(ValueError, match="active_sampling"):
        Config(teacher_model_name_or_path="t", beta=1.0, reward_advantage=False, active_sampling=True,
               kl_estimator="advantage")
    Config(teacher_model_name_or_path="t", beta=1.0, reward_advantage=False, kl_estimator="advantage")


def test_a_teacher_refuses_the_estimators_that_do_not_follow_the_kl_they_estimate():
    """Beside a teacher, k1's gradient is zero in expectation and k3's is the forward KL(teacher || student)
    while its value is the reverse's (tests/test_kl_directions.py): both refused in one line naming the fix, k3
    (kl_estimator's default) too when not asked for; the four whose gradient is the reverse KL and topk_forward
    pass, with or without the reward."""
    for asked in ({}, {"kl_estimator": "k3"}):
        with pytest.raises(ValueError, match=r"^teacher_model_name_or_path with kl_estimator='k3': k3's gradient is "
                                             r"the forward KL\(teacher \|\| student\) while its value estimates the "
                                             r"reverse KL\(student \|\| teacher\); pick advantage .*, topk, k2 or k4 "
                                             r"\(the reverse KL\), or topk_forward \(the forward\)$"):
            Config(teacher_model_name_or_path="t", beta=1.0, **asked)
    for reward_advantage in (True, False):
        with pytest.raises(ValueError, match="k1's gradient is zero in expectation: the teacher would pull nothing"):
            Config(teacher_model_name_or_path="t", beta=1.0, kl_estimator="k1", reward_advantage=reward_advantage)
        for kl_estimator in ("advantage", "topk", "k2", "k4", "topk_forward"):
            Config(teacher_model_name_or_path="t", beta=1.0, kl_estimator=kl_estimator,
                   reward_advantage=reward_advantage)
    Config(beta=1.0)  # without a teacher k3 stays the default (the reference's KL in GRPO's own form)


def test_a_teacher_with_another_tokenizer_or_none_is_refused(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    cfg = Config(model_name_or_path=tiny_model_dir, teacher_model_name_or_path=str(tmp_path / "nowhere"), beta=1.0,
                 kl_estimator="advantage")
    with pytest.raises(ValueError, match="is not a local model directory"):
        teacher.check(cfg, tokenizer, cuda=False)
    other = tmp_path / "other"
    shutil.copytree(tiny_model_dir, other)
    spec = json.loads((other / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    a, b = list(vocab)[10:12]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two ids swapped: every other token the same
    (other / "tokenizer.json").write_text(json.dumps(spec))
    cfg = Config(model_name_or_path=tiny_model_dir, teacher_model_name_or_path=str(other), beta=1.0,
                 kl_estimator="advantage")
    with pytest.raises(ValueError, match=r"has another tokenizer than model_name_or_path=.* \(4 token/id pairs differ\)"):
        teacher.check(cfg, tokenizer, cuda=False)
    teacher.check(Config(model_name_or_path=tiny_model_dir, teacher_model_name_or_path=tiny_model_dir, beta=1.0,
                         kl_estimator="advantage"), tokenizer, cuda=False)


def test_a_teacher_with_more_embedding_rows_than_the_student_is_refused_for_the_top_k_kl(tiny_model_dir, tmp_path):
    """The student's tokenizer with more rows in the teacher's embedding (Qwen2.5-7B's 152,064 against 0.5B's
    151,936): the teacher's top k could name an id past the student's rows, where the student's forward
    gathers its logprobs (out of range). Refused in one line for kl_estimator='topk' with a head; the
    estimators that read the sampled token's logprob alone pass."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    bigger = tmp_path / "bigger"
    shutil.copytree(tiny_model_dir, bigger)
    spec = json.loads((bigger / "config.json").read_text())
    (bigger / "config.json").write_text(json.dumps(spec | {"vocab_size": 72}))  # the tiny student's: 64
    pair = dict(model_name_or_path=tiny_model_dir, teacher_model_name_or_path=str(bigger), beta=1.0)
    with pytest.raises(ValueError, match=r"^teacher_model_name_or_path=.* has 72 embedding rows, the student 64: its "
                                         r"top k can name an id the student lacks; .*kl_estimator='advantage'"):
        teacher.check(Config(**pair, kl_estimator="topk", kl_topk=4), tokenizer, cuda=False)
    teacher.check(Config(**pair, kl_estimator="advantage"), tokenizer, cuda=False)
    teacher.check(Config(**pair, kl_estimator="topk", kl_topk=0), tokenizer, cuda=False)  # no head: k4


@pytest.mark.subprocess
def test_train_py_refuses_a_missing_teacher_in_one_line(tiny_model_dir, tmp_path):
    out = run([sys.executable, "train.py", "--model_name_or_path", tiny_model_dir, "--output_dir", str(tmp_path / "out"),
               "--teacher_model_name_or_path", str(tmp_path / "nowhere"), "--beta", "1.0",
               "--kl_estimator", "advantage"])
    assert out.returncode == 2 and out.stderr.strip().count("\n") == 0, out.stderr[-2000:]
    assert "teacher_model_name_or_path=" in out.stderr and "not a local model directory" in out.stderr


# --- the teacher's server (real vLLM)


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    """The tiny model's architecture and tokenizer with other weights: a teacher that is not the student."""
    import make_tiny_model

    out = str(tmp_path_factory.mktemp("teacher"))
    make_tiny_model.main(["--out", out, "--seed", "7"])
    return out


@pytest.mark.slow
@pytest.mark.parametrize("k", [0, 4])
def test_the_teachers_server_agrees_with_the_teacher_in_the_trainer(teacher_dir, tmp_path, k):
    """The alignment check, as the sync check does it for the policy: the teacher's logprobs of a sample's
    policy tokens, from its server, against a forward of the teacher here on the same tokens; with k,
    its top k against the forward's top k at each position."""
    from transformers import AutoModelForCausalLM

    cfg = Config(model_name_or_path=teacher_dir, teacher_model_name_or_path=teacher_dir, beta=1.0, max_prompt_length=8,
                 response_length=12, output_dir=str(tmp_path), kl_estimator="topk" if k else "advantage", kl_topk=k,
                 vllm_enforce_eager=True)
    gen = torch.Generator().manual_seed(0)
    samples = [Sample([1, 5, 9], torch.randint(3, 60, (12,), generator=gen).tolist(), [0.0] * 12,
                      mask=[1] * 4 + [0] * 3 + [1] * 5),
               Sample([1, 5, 9, 4], torch.randint(3, 60, (8,), generator=gen).tolist(), [0.0] * 8,
                      mask=[1] * 3 + [0] * 2 + [1] * 3, restarts=(3,)),
               # the longest a run makes: max_prompt_length + response_length tokens, and the request asks one more
               Sample(list(range(3, 11)), torch.randint(3, 60, (12,), generator=gen).tolist(), [0.0] * 12)]
    ref = teacher.Teacher(cfg, 0)
    try:
        got = ref.ask(samples, [s.prompt_ids for s in samples])
    finally:
        ref.close()
    model = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32)
    for s, scores in zip(samples, got):
        want, heads = [], []
        for ids, first, at in teacher.sequences(s):
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
            lp = trainer_logprobs(model, [ids])[0]
            for j in range(len(ids) - at):
                if s.mask[first + j]:
                    want.append(lp[at + j - 1])
                    heads.append(torch.log_softmax(logits[at + j - 1], -1).topk(k))
        assert len(scores["ref_logp"]) == len(want) == sum(s.mask)
        assert max(abs(a - b) for a, b in zip(scores["ref_logp"], want)) < 1e-4
        if k:
            for ids, lps, (top_lp, top_ids) in zip(scores["ref_head_ids"], scores["ref_head_logp"], heads):
                assert sorted(ids) == sorted(top_ids.tolist())
                assert torch.allclose(torch.tensor(lps), top_lp, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("kl_estimator", ["topk", "topk_forward"])
def test_distillation_from_a_teacher_equal_to_the_student_reads_a_kl_of_zero(tiny_model_dir, tmp_path, kl_estimator):
    """Two ranks, the student's own weights as the teacher, a top-k KL alone (the reverse or the forward): at
    step 1 (the student still its initial weights) the KL to the teacher is 0 to float32's rounding on every
    rank's tokens, logged under its direction's name, and the memory plan counts the teacher's server."""
    args = ["--model_name_or_path", tiny_model_dir, "--output_dir", str(tmp_path / "out"), "--num_training_steps", "2",
            "--eval_freq", "0", "--seed", "5", *EAGER, "--teacher_model_name_or_path", tiny_model_dir, "--beta", "1.0",
            "--kl_estimator", kl_estimator, "--kl_topk", "4", "--reward_advantage", "false",
            "--num_unique_prompts_rollout", "2", "--num_samples_per_prompt_rollout", "4", "--response_length", "16"]
    out = run(command("train.py", 2) + args)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    rows, key = metrics(tmp_path), "teacher_kl" + ("_forward" if kl_estimator == "topk_forward" else "")
    assert [r["step"] for r in rows] == [1, 2] and all({"kl", "teacher_kl", "teacher_kl_forward"} & set(r) == {key}
                                                       for r in rows)
    assert abs(rows[0][key]) < 1e-6 and rows[0]["trained_tokens"] > 0 and rows[1][key] != rows[0][key]
    assert "teacher_weights" in out.stdout and os.path.exists(tmp_path / "out" / "teacher_vllm.log")


@pytest.mark.slow
def test_distillation_from_the_student_with_a_system_prompt_of_its_own_reads_a_kl_above_zero(tiny_model_dir, tmp_path):
    """Two ranks, the student's own weights as the teacher, which alone sees a system prompt
    (teacher_context_file): the prefix changes the teacher's distribution, so at step 1 (the student still
    its initial weights) the KL to it is finite and above zero, where without it it is 0."""
    (tmp_path / "context.json").write_text(json.dumps([{"role": "system", "content": "Copy the text exactly."}]))
    args = ["--model_name_or_path", tiny_model_dir, "--output_dir", str(tmp_path / "out"), "--num_training_steps", "2",
            "--eval_freq", "0", "--seed", "5", *EAGER, "--teacher_model_name_or_path", tiny_model_dir, "--beta", "1.0",
            "--teacher_context_file", str(tmp_path / "context.json"), "--apply_chat_template", "true",
            "--kl_estimator", "advantage", "--reward_advantage", "false", "--num_unique_prompts_rollout", "2",
            "--num_samples_per_prompt_rollout", "4", "--response_length", "16"]
    out = run(command("train.py", 2) + args)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(math.isfinite(r["teacher_kl"]) for r in rows) and abs(rows[0]["teacher_kl"]) > 1e-3, rows[0]


def test_the_memory_plan_counts_the_teachers_server_and_its_prompt_logits(tiny_model_dir):
    """The teacher's server planned as the policy's, plus a whole sequence's logits and log-softmax over the
    vocabulary in float32 (vLLM's profile leaves them out): by hand for the tiny model (vocabulary 64)."""
    import train
    from infra import memory

    cfg = Config(model_name_or_path=tiny_model_dir, teacher_model_name_or_path=tiny_model_dir, beta=1.0,
                 kl_estimator="advantage", max_prompt_length=100, response_length=27)
    plan = train.server_plan(cfg, *_meta(tiny_model_dir), cuda=False)
    assert plan["teacher_prompt_logits"] == 2 * 4 * (100 + 27 + 1) * 64
    assert {"teacher_weights", "teacher_kv_cache", "teacher_runtime"} < plan.keys()
    policy = memory.server_plan(Config(model_name_or_path=tiny_model_dir, beta=1.0, max_prompt_length=100,
                                       response_length=27), *_meta(tiny_model_dir), cuda=False)
    assert plan["teacher_weights"] == policy["weights"] and plan["teacher_kv_cache"] == policy["kv_cache"]



def test_the_teachers_server_counts_the_tokens_its_context_adds(tiny_model_dir, tmp_path):
    """A system prompt of the teacher's own: its server's context and prompt logits count the tokens the
    tiny template's system turn adds (it has no default system prompt: all of it is added)."""
    import train
    from transformers import AutoTokenizer

    (tmp_path / "c.json").write_text(json.dumps([{"role": "system", "content": "Think."}]))
    cfg = Config(model_name_or_path=tiny_model_dir, teacher_model_name_or_path=tiny_model_dir, beta=1.0,
                 kl_estimator="advantage", max_prompt_length=100, response_length=27, apply_chat_template=True,
                 teacher_context_file=str(tmp_path / "c.json"))
    turn = AutoTokenizer.from_pretrained(tiny_model_dir)("<|im_start|>system\nThink.<|im_end|>\n",
                                                         add_special_tokens=False)["input_ids"]
    assert teacher.teacher_context(cfg, teacher.own_context(cfg)) == 100 + 27 + 1 + len(turn)
    plan = train.server_plan(cfg, *_meta(tiny_model_dir), cuda=False)
    assert plan["teacher_prompt_logits"] == 2 * 4 * (100 + 27 + 1 + len(turn)) * 64


def _meta(path):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    mc = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        return mc, AutoModelForCausalLM.from_config(mc)


def test_plot_curves_averages_seeds_and_joins_a_continued_run(tmp_path, capsys):
    """The demo's table (scripts/plot_curves.py): seeds averaged with their range, a run continued by another
    (GRPO from a distilled export) placed after the first's last step, its own step 0 dropped."""
    import plot_curves

    def write(name, evals):
        with open(tmp_path / name, "w") as f:
            for step, acc in evals.items():
                f.write(json.dumps({"step": step, "eval_accuracy": acc}) + "\n" + json.dumps({"step": step}) + "\n")
        return str(tmp_path / name)

    a, b = write("a.jsonl", {0: 0.0, 2: 0.25, 4: 0.5}), write("b.jsonl", {0: 0.0, 2: 0.5, 4: 0.75})
    more = write("more.jsonl", {0: 0.4, 2: 1.0})  # its step 0 is dropped: the first run has step 4
    plot_curves.main([f"seeds={a},{b}", f"then={a}+{more}", "--level", "teacher=0.5",
                      "--out", str(tmp_path / "p.png")])
    out = capsys.readouterr().out.splitlines()
    assert out[2:7] == ["| 0 | 0.000 | 0.000 |", "| 2 | 0.375 (0.25-0.50) | 0.250 |",
                        "| 4 | 0.625 (0.50-0.75) | 0.500 |",
                        "| 6 |  | 1.000 |", "seeds: first within 0.02 of teacher (0.500) at step 4"]
    assert out[7] == "then: first within 0.02 of teacher (0.500) at step 4" and os.path.getsize(tmp_path / "p.png") > 0
