"""The environment that runs the policy's Python: a per-episode interpreter in the sandbox
(envs/sandbox.py).

    --environment envs.python_tool:PythonTool

Its doors: none; the trainer loads it by its spec like any environment.
"""

import re

from envs import sandbox
from envs.sandbox import START_TIME, Interpreter, Limits
from envs.tool_calls import Starved, ToolError, Unavailable


class PythonTool:
    """The policy writes <python>code</python>; the code runs in the episode's Interpreter and
    what it printed comes back as a tool message. A turn without code ends the episode. The code's
    exception or a limit is the policy's mistake: told as "error: ..." and counted (tool_bad_calls),
    but for the wall clock reached on a loaded machine (tool_starved). A sandbox that cannot start is ours: the run checks it at start-up (check, where the calls run),
    and should it fail later the episode ends unscored (tool_unavailable), never told to the policy."""

    stop = ["</python>"]
    limits = Limits(cpu=5, wall=5.0)
    # the seconds one call may need: the interpreter's start, the cell's wall clock, the kill after
    # it; the trainer refuses a tool_timeout below it (envs.environment.check_needs)
    call_time = START_TIME + limits.wall + 1.0
    system = ("You can run Python. Write code between <python> and </python>, for example <python>print(2 ** 10)"
              "</python>; what it prints is shown to you. Variables are kept from one call to the next. "
              "Give the final answer as \\boxed{answer}.")

    def __init__(self):
        self.interpreter = None  # started by the first call: the trainer's probe instance never runs code

    def reset(self, row):
        prompt = row["prompt"]
        question = prompt if isinstance(prompt, str) else prompt[-1]["content"]
        return [{"role": "system", "content": self.system}, {"role": "user", "content": question}]

    @classmethod
    def check(cls):
        """One cell in a fresh sandbox (envs.environment.Environment.start runs it where the calls run):
        where bwrap is missing or cannot make namespaces the run stops here, in one line."""
        sandbox.probe(cls.limits)

    def step(self, row, messages):
        call = re.search(r"<python>(.*?)</python>", messages[-1]["content"], re.S)
        if call is None:
            return []
        self.interpreter = self.interpreter or Interpreter(self.limits)
        try:
            result = self.interpreter.run(call.group(1))
        except RuntimeError as e:  # the sandbox did not start (Interpreter.start): ours, not the code's
            raise Unavailable(str(e)) from None
        output = (result.stdout + result.stderr).strip()
        if result.ours(self.limits):  # the wall clock on a loaded machine: not the code's (faults.py)
            raise Starved(f"{result.error}, {result.waited:.1f} s of it waiting for a CPU (the sandbox got "
                          f"{result.cpu:.1f} s of CPU)")
        if result.error:
            raise ToolError(f"{result.error}\n{output}".strip())
        return [{"role": "tool", "content": output}]

    def close(self):
        if self.interpreter:
            self.interpreter.close()
