"""On-policy distillation, an optional concept in one folder: teacher.py (a teacher model served by a
vLLM server of its own, scoring every token the student sampled) and context.py (what the teacher sees
before the prompt that the student does not: context distillation, --teacher_context_file). `rm -r distill`
leaves a trainer that runs everything but --teacher_model_name_or_path; a plain run imports none of it.

The teacher is a kind of reference: the KL term (beta, kl_estimator) reads it as it reads a fixed
or moving reference, so the objectives are loss.py's rows (the sampled k1 as a per-token advantage,
kl_estimator="advantage"; EMA-PG's top-k KL over the teacher's top k, kl_estimator="topk"; the forward KL over
the same head, GKD's, kl_estimator="topk_forward").

Its doors, each only when teacher_model_name_or_path is set:
- reference.py:make_reference  teacher.Teacher, the run's reference (it launches the server)
- train.py:check_model         teacher.check: the teacher's files and tokenizer, before anything starts
- train.py:server_plan         teacher.server_plan: the teacher's server in the memory plan, beside the policy's
"""
