"""The teacher of on-policy distillation: a reference whose logprobs a vLLM server of its own answers.

    ref = Teacher(cfg, rank)          # rank 0 launches the server on teacher_model_name_or_path
    ref.prepare(samples)              # every rank, each step before packing: rank 0 asks, every rank gets
    ref.logprobs(forward, b, ...)     # the teacher's logp of micro-batch b's tokens (and its top k), from b

The student samples; the teacher scores every token it wrote; the KL term (loss.py) pulls the
student toward the teacher on the student's own samples. With kl_estimator advantage, topk, k2 or k4
its expected gradient is that of the reverse KL(student || teacher) at each position (mode-seeking;
the prefix's probability is not differentiated: the discount of zero of Thinking Machines' "On-Policy
Distillation"); k3's would be the forward KL(teacher || student)'s and k1's zero, so Config refuses
both beside a teacher (docs/algorithm.md derives each; tests/test_kl_directions.py enumerates them).

vLLM scores a prompt's tokens (prompt_logprobs): entry j is log p(token j | tokens before j), entry 0
is None, and with prompt_logprobs=k the k most likely tokens at j come with it. A sample goes as one prompt
(its prompt and every token after it; each sequence of an agent's episode apart) with max_tokens=1,
so sampled token i is entry len(prompt) + i, the alignment of the trainer's own next-token targets.
The environment's tokens are scored and dropped with the mask.

Prompt logprobs skip vLLM's sampler: they are the teacher's at temperature 1, so Config refuses a
teacher beside another sampling temperature (the KL would compare two different temperatures).

For the top-k KLs (kl_estimator="topk", the reverse; "topk_forward", the forward) the exact head is the
teacher's k most likely tokens at each position. EMA-PG's estimator (and its forward twin,
loss.kl_topk_forward) is unbiased for any head chosen before the token at that position is
sampled (the tail term covers the rest), and the teacher's top k is such a head; it is also the
only one a server that reports its own top k can give, where a reference in the trainer reports
its logprobs at any ids (there the head is the sampling policy's k). The student's forward reads its
logprobs at the teacher's ids, so check refuses a teacher with more embedding rows than the student.
"""

import atexit
import os
import time

from infra import memory, ranks, vllm_client, vllm_server
from infra.faults import VLLMError
from infra.model_files import load_model_config


def teacher_context(cfg, context=None):
    """A teacher's context: one token past the longest sample, whose request asks for one (max_tokens=1),
    and the tokens its own context (teacher_context_file) adds to the prompt at most."""
    longest = cfg.vllm_max_model_len or cfg.max_prompt_length + cfg.response_length
    return longest + 1 + (context.extra if context else 0)


def own_context(cfg):
    """The teacher's context (distill/context.py) of teacher_context_file, None without one."""
    if not cfg.teacher_context_file:
        return None
    from transformers import AutoTokenizer

    from distill import context

    return context.Context(AutoTokenizer.from_pretrained(cfg.teacher_model_name_or_path),
                           context.load(cfg.teacher_context_file))


def server_plan(cfg, cuda):
    """{teacher_item: bytes} of the teacher's server for the memory plan (infra/memory.py): planned as the
    policy's on its own config, with the prompt logits it holds beside them, which vLLM's memory profile
    leaves out: a whole sequence's logits over the vocabulary and their log-softmax in float32 (vLLM
    computes them one request at a time)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    tc = AutoConfig.from_pretrained(cfg.teacher_model_name_or_path)
    with torch.device("meta"):
        teacher = AutoModelForCausalLM.from_config(tc)
    plan = {f"teacher_{k}": v for k, v in memory.model_server(cfg, tc, teacher, cuda).items()}
    return plan | {"teacher_prompt_logits": 2 * 4 * teacher_context(cfg, own_context(cfg)) * tc.vocab_size}


def check(cfg, tokenizer, cuda):
    """Before anything starts: the teacher's files, the student's tokenizer (the KL compares the two
    models' logprobs of the same token ids) and, for the top-k KL, the embedding rows its head's ids
    index in the student. ValueError naming the fix."""
    from transformers import AutoConfig, AutoTokenizer

    path = cfg.teacher_model_name_or_path
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"teacher_model_name_or_path={path!r} is not a local model directory (no config.json); "
                         "pass the directory of a Hugging Face model that shares the student's tokenizer")
    if cuda:  # train.py would start it on the GPU of rank 0, beside that rank and a colocated policy server
        raise ValueError("teacher_model_name_or_path on GPUs: the trainer does not yet give a teacher's server GPUs "
                         "of its own (it runs on the CPU, tested there); distil on a CPU machine for now")
    try:
        theirs = AutoTokenizer.from_pretrained(path).get_vocab()
    except (OSError, ValueError) as e:
        raise ValueError(f"teacher_model_name_or_path={path!r}: its tokenizer does not load ({type(e).__name__}); "
                         "the teacher must ship the student's tokenizer") from None
    ours = tokenizer.get_vocab()
    if theirs != ours:
        differ = len(set(theirs.items()) ^ set(ours.items()))
        raise ValueError(f"teacher_model_name_or_path={path!r} has another tokenizer than model_name_or_path="
                         f"{cfg.model_name_or_path!r} ({differ} token/id pairs differ): the KL compares the logprobs "
                         "of the same token ids; pick a teacher of the student's family")
    if cfg.teacher_context_file:  # the file loads, and the template renders the teacher's chat as a splice
        from distill import context

        context.checked(tokenizer, cfg.teacher_context_file)
    # One tokenizer, not one embedding: Qwen2.5-7B has 152,064 rows, 0.5B 151,936 (padding past the tokens).
    # The teacher's top k are ids its server ranks over its own rows, and the student's forward gathers its
    # logprobs at them (update.frozen_logprobs): an id past the student's rows would index out of range.
    if not cfg.topk_kl or not cfg.kl_topk:
        return
    teacher_rows, student_rows = AutoConfig.from_pretrained(path).vocab_size, load_model_config(cfg).vocab_size
    if teacher_rows > student_rows:
        raise ValueError(f"teacher_model_name_or_path={path!r} has {teacher_rows} embedding rows, the student "
                         f"{student_rows}: its top k can name an id the student lacks; use kl_estimator='advantage' "
                         "(or k2, k4: they read the sampled token's logprob alone), or a teacher of the student's rows")


def sequences(s, prompt_ids=None):
    """The sequences of sample s the teacher scores: (token ids, the index in s.token_ids of its first
    token after the prompt, that token's position in it). An agent's episode may restart (Sample.restarts).
    prompt_ids: the teacher's prompt in place of the student's (its own context, distill/context.py):
    the first sequence is it and every token of the episode after the student's prompt (the environment's
    too), so sampled token i is at len(prompt_ids) + i; a restarted sequence is the episode's own."""
    prompt_ids = s.prompt_ids if prompt_ids is None else prompt_ids
    cuts = [0, *s.restarts, len(s.token_ids)]
    return [((prompt_ids if m == 0 else []) + s.token_ids[a:b], a, len(prompt_ids) if m == 0 else 0)
            for m, (a, b) in enumerate(zip(cuts, cuts[1:]))]


def scores(s, answers, k, prompt_ids=None):
    """The teacher's answers for sample s (prompt_logprobs of each of its sequences(s, prompt_ids)) as lists
    over its policy tokens, in the mask's order (packing.loss_tokens): ref_logp, and with k > 0 ref_head_ids
    and ref_head_logp, the teacher's k most likely tokens at each position. The prompt's entries are
    dropped, the teacher's own context's with them."""
    out = dict(ref_logp=[], ref_head_ids=[], ref_head_logp=[])
    for (ids, first, at), entries in zip(sequences(s, prompt_ids), answers):
        for j in range(len(ids) - at):  # token first + j of the sample is token at + j of this sequence
            if not s.mask[first + j]:
                continue
            entry, token = entries[at + j], str(s.token_ids[first + j])
            if entry is None or token not in entry:
                raise VLLMError(f"the teacher's server did not score sampled token {first + j} (id {token})")
            out["ref_logp"].append(entry[token]["logprob"])
            if k:  # the top k, and the sampled token when it is not among them (then k + 1 entries)
                head = sorted(((int(i), e["logprob"]) for i, e in entry.items() if i != token or len(entry) == k),
                              key=lambda x: -x[1])
                out["ref_head_ids"].append([i for i, _ in head])
                out["ref_head_logp"].append([lp for _, lp in head])
    return out if k else dict(ref_logp=out["ref_logp"])


class Teacher:
    """A reference (reference.py's seam) that does not move and holds no weights in the trainer: its
    logprobs come with the micro-batch (prepare puts them on the samples, packing carries them)."""

    ref_params = ()  # nothing moves, and a checkpoint holds nothing of it

    def __init__(self, cfg, rank):
        self.rank = rank
        self.topk = cfg.topk_kl
        self.k = cfg.kl_topk if self.topk else 0
        self.server = self.client = None
        self.context = own_context(cfg) if rank == 0 else None  # what the teacher sees before the prompt
        # rank 0 launches it (one that does not start ends every rank in one line); a Teacher(rank=1) without a
        # process group has no server (the tests' teacher)
        ranks.from_rank0(lambda: self.launch(cfg) if rank == 0 else None)

    def launch(self, cfg):
        """Rank 0: the teacher's server, stopped at exit, and its client."""
        log = os.path.join(cfg.output_dir, "teacher_vllm.log")
        context = teacher_context(cfg, self.context)
        try:
            self.server, url = vllm_server.launch_server(
                cfg.teacher_model_name_or_path, cfg, log,
                extra_args=("--max-logprobs", str(max(self.k, 1)), "--max-model-len", str(context),
                            "--max-num-batched-tokens", str(max(2048, context, memory.server_sequences(cfg)))))
        except VLLMError as e:
            raise VLLMError(f"the teacher's server: {e}") from None
        atexit.register(self.close)
        self.client = vllm_client.VLLMClient([url], cfg.teacher_model_name_or_path, cfg.vllm_request_timeout,
                                             cfg.vllm_max_retries, proc=self.server, log_path=log)

    def ask(self, samples, prompts):
        """Rank 0: every sample's scores (a list of dicts, scores()), from one request per sequence, the
        first with the teacher's prompt (prompts: one a sample)."""
        asked = [(i, ids) for i, (s, p) in enumerate(zip(samples, prompts)) for ids, _, _ in sequences(s, p)]
        got = self.client.map("/v1/completions", [dict(model=self.client.model, prompt=ids, max_tokens=1,
                                                       temperature=1.0, prompt_logprobs=self.k) for _, ids in asked])
        answers = [[] for _ in samples]
        for (i, ids), resp in zip(asked, got):
            entries = resp["choices"][0]["prompt_logprobs"]
            if len(entries) != len(ids):
                raise ValueError(f"{len(entries)} prompt logprobs for a sequence of {len(ids)} tokens")
            answers[i].append(entries)
        return [scores(s, a, self.k, p) for s, a, p in zip(samples, answers, prompts)]

    def scored(self, samples):
        """Rank 0: ask(samples), any failure of the teacher's server or its answers a VLLMError (which
        ends every rank in one line)."""
        prompts = [self.context.prompt(s.prompt_ids) if self.context else s.prompt_ids for s in samples]
        try:
            return self.ask(samples, prompts)
        except VLLMError as e:
            raise VLLMError(f"the teacher's server: {e}") from None
        except (KeyError, IndexError, TypeError, ValueError) as e:  # an answer not of the form asked for
            raise VLLMError(f"the teacher's server answered what it was not asked ({type(e).__name__}: {e})") from None

    def prepare(self, samples):
        """Every rank: each sample's `ref` (the teacher's scores of its policy tokens); rank 0 asks the
        server and broadcasts them. VLLMError on every rank when it cannot. Returns the seconds it took."""
        start = time.perf_counter()
        for s, ref in zip(samples, ranks.from_rank0(lambda: self.scored(samples))):  # the others wait on the CPU
            s.ref = ref
        return dict(time_teacher=time.perf_counter() - start)

    def logprobs(self, forward, b, head_ids=None):
        """The teacher's logp (N,) of b's tokens and, for the top-k KL, its logp (N, k) at its own top-k ids
        (N, k), which the policy's forward then reads (update.frozen_logprobs)."""
        logp = b.get("ref_logp", b["vllm_logp"].new_zeros(0))  # none in a micro-batch of padding alone
        if not self.topk:
            return logp, None, None, None
        n = len(logp)  # kl_topk=0: an empty head (the sampled k4)
        ids = b["ref_head_ids"].view(n, self.k) if self.k and n else b["seq_ids"].new_zeros(n, self.k)
        return logp, None, b["ref_head_logp"].view(n, self.k) if self.k and n else logp.new_zeros(n, self.k), ids

    def step(self, step):
        pass

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass

    def close(self):
        vllm_server.stop_server(self.server)
        self.server = None
