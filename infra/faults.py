"""Whose failure is it: the policy's mistake, or ours. Every failure an episode can meet is one row
of FAULTS, named by the metric that counts it, and every file that meets one asks here.

- the policy's (POLICY): the policy's input caused it, and it can learn not to. The failure is told to
  the policy as a tool message ("error: ..."), the episode goes on, is scored and trained on.
- ours (OURS): the infrastructure's (a worker killed, a call that timed out, a reward that failed, a
  sandbox that did not start, an environment that could not be made). The episode ends unscored: its
  group leaves the batch (rollout.sample_groups), counted, and --unscored_stop stops a run that loses more than
  that fraction of a step's groups. Nothing of ours is ever a reward the policy learns from.

A failure nobody can pin on the policy is ours: a timeout or a worker's death may follow from what
the policy wrote, but may as well be a loaded machine or the OOM killer, and a group dropped costs
samples where a wrong reward costs the run. Where the kernel can tell, it decides: a sandboxed cell
at its wall clock is the policy's when it had the CPU (it computed, slept, or kept its own thread
waiting behind processes of its own), ours when its thread spent over half the wall clock waiting
on the run queue for a CPU while all its processes together got less than half a CPU
(/proc/PID/schedstat and stat; envs/sandbox.py, Result.ours). On a machine that loaded, code that
starves itself on purpose cannot be told from code starved by others: ours, so unscored, never a
reward. An environment tells the policy of its mistakes with
envs.tool_calls.ToolError, and of its own with envs.tool_calls.Unavailable. The same rows hold for a shared
environment and a per-episode one, in a worker or in the trainer (tool_workers=0: no timeout, no
crash). docs/operations.md ("Whose failure is it") is this table as users read it.
"""

POLICY, OURS = "policy", "ours"

FAULTS = {  # the metric that counts it: (whose, what it is)
    # an --environment's calls (envs/calls.py, envs/environment.py, worker_pool.CallPool)
    "tool_bad_calls": (POLICY, "the environment raised ToolError, a tool function raised, or the parser could not "
                               "read the policy's call; the policy's code failed or reached a limit in the sandbox"),
    "tool_errors": (OURS, "the environment's step raised an exception other than ToolError, or returned something "
                           "that is not a list of messages; a per-episode instance's close() raised"),
    "tool_unavailable": (OURS, "the tool could not run (envs.tool_calls.Unavailable: a sandbox that cannot start)"),
    "tool_starved": (OURS, "the policy's code reached the sandbox's wall clock after waiting for a CPU (the run "
                           "queue) for more than half of it, its processes together given less than half a CPU: a "
                           "loaded machine (envs.tool_calls.Starved)"),
    "tool_resets": (OURS, "a per-episode environment's constructor or reset(row) raised"),
    "tool_reset_mismatch": (OURS, "a per-episode environment's reset(row) gave other messages than the ones its "
                                  "prompt was rendered from at load time (an unseeded, nondeterministic reset)"),
    "tool_timeouts": (OURS, "a call ran past tool_timeout: its worker was killed"),
    "tool_crashes": (OURS, "a call's worker died (a signal, or an exit)"),
    "tool_lost": (OURS, "the episode's per-episode instance died with its worker in another episode's call"),
    # the reward: --reward_fn, the dataset's, an environment's or an agent's reward() (worker_pool.RewardPool)
    "reward_errors": (OURS, "the reward raised, or returned something that is not a finite number"),
    "reward_timeouts": (OURS, "the reward ran past reward_timeout (tool_timeout for an environment's)"),
    "reward_crashes": (OURS, "the reward's worker died"),
    "reward_none": (OURS, "a TRL-form reward returned None (not applicable) and no other reward scores the sample"),
    # an agent program (agent_programs/runner.py, agent_programs/gateway.py)
    "agent_policy_failures": (POLICY, "the program raised agent_programs.PolicyFailed, or a framework's own limit "
                                      "on the policy (POLICY_EXCEPTIONS: max turns, requests, recursion)"),
    "agent_errors": (OURS, "the program raised, exited non-zero, or returned something that is not a number"),
    "agent_timeouts": (OURS, "the program ran past agent_timeout"),
    "agent_crashes": (OURS, "the program's worker died"),
    "agent_refused": (OURS, "the gateway could not serve one of its calls (a prompt past the context, tools and no "
                            "--tool_call_parser, the server's failure)"),
    "agent_idle": (OURS, "the program never called the model"),
}
# And one failure that is no episode's: the vLLM server's. The step stops there, a server we launched is
# restarted and the step played again (generator.Generator.batch); one the user runs stops the run.


# --- what stops a run: train.py catches these three, checkpoints what was trained and exits in one line


class VLLMError(RuntimeError):
    """A server that cannot be reached, answers with an error, or dies (vllm_client.py, vllm_server.py)."""

    every_rank = True  # rank 0's, raised on every rank as itself (infra/ranks.py), printed once


class SyncError(RuntimeError):
    """The trainer's logprobs and vLLM's disagree on tokens the current weights sampled: the
    last weight sync did not take (update.StepMetrics.check_sync)."""

    every_rank = True


class Refused(RuntimeError):
    """A step that cannot go on (too many groups unscored, an environment's answer the policy would
    never see): the run stops, on every rank, in one line (Generator.batch, train.py)."""

    every_rank = True


def ours(kind):
    """True when the failure `kind` (a key of FAULTS) is the infrastructure's: its episode is unscored.
    None (no failure) is nobody's; a kind missing from the table is a bug, and raises KeyError."""
    return kind is not None and FAULTS[kind][0] == OURS


# The exceptions that say the policy failed inside an agent program (agent_policy_failures: scored and
# trained on, as the program's return of the reward it gives, None when not given). A framework that
# stops an agent still calling tools at its own limit raises one; a policy that never stops calling
# tools is the policy's mistake, the one the trainer should teach it out of. Found by module and class
# name along the exception's class hierarchy, so nothing here imports a framework. smolagents raises
# nothing at max_steps: it asks the model for a final answer and returns that, scored as any answer.
POLICY_EXCEPTIONS = {
    ("agent_programs", "PolicyFailed"): "the program says so (docs/data.md)",
    ("agents.exceptions", "MaxTurnsExceeded"): "the OpenAI Agents SDK's Runner.run(max_turns=...)",
    ("pydantic_ai.exceptions", "UsageLimitExceeded"): "pydantic-ai's UsageLimits(request_limit=..., ...)",
    ("langgraph.errors", "GraphRecursionError"): "LangGraph's recursion_limit",
}


def policy_failed(error):
    """True when the exception `error`, raised by an agent program, is the policy's failure
    (POLICY_EXCEPTIONS, or a subclass of one)."""
    return any((c.__module__, c.__name__) in POLICY_EXCEPTIONS for c in type(error).__mro__)
