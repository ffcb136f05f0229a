"""What a run stands on: the command line, FSDP2's set-up, the policy's forward and its attention
kernels, the vLLM server we launch and its client, the weights into it, the memory plan, worker
processes, user code by flag, model files, checkpoints, tracking and whose failure is whose.

A researcher changing the algorithm reads the root (train.py, config.py, rollout.py, loss.py,
reference.py, update.py, episodes.py, packing.py, data.py, rewards.py) and may stop here. Its one
rule (tests/test_doors.py): infra imports nothing outside infra and names no optional concept;
the root opens every door (the loop hands load_model its converter, the generator its batch maker
and its weight sync, the export its transform).
"""
