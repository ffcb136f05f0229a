"""Environments others wrote: an OpenEnv environment (openenv-core's Environment, `reset()` and
`step(action)` returning observations that carry `done` and `reward`), run unmodified, in
process, as a per-episode environment of this trainer.

    # dipg.py: --environment dipg.py:DIPG (a class: one OpenEnv environment per episode)
    from envs.openenv_adapter import OpenEnv

    class DIPG(OpenEnv):
        def make(self, row):                  # the row's environment, built by the episode's first call
            return DIPGEnvironment(dataset=Dataset.from_list([...row...]), ...)
        def action(self, text):               # the policy's turn as the environment's Action; with
            return DIPGAction(llm_response=text)  # --tool_call_parser, action(text, tool_calls) for a call
        def observe(self, observation):       # an Observation as the text the policy reads
            return f"{observation.context}\\n\\n{observation.question}"

Each episode: `make(row)` then the environment's `reset()`, whose observation is the first user
message; each policy turn is `step(action(text))`, or `step(action(text, tool_calls))` for a turn
in which a --tool_call_parser read calls (the OpenAI form: [{"id", "type", "function": {"name",
"arguments"}}]), whose observation comes back as a user message until it says `done`; the
episode's reward is the sum of the rewards its steps returned. When max_turns or the token budget
ended the episode before the environment did, its final turn is stepped at the end, so that the
environment scores it (a one-turn environment, max_turns 1, scores that way). Each assistant turn
reaches the environment at most once: one refused with a ToolError is not stepped again.
OpenEnv has no messages of its own: `observe` writes what the policy sees. The prompt is
rendered once per row from an instance of its own, closed at once with its environment, so
`make(row)` must give the same first observation for the same row (an environment that draws its
task at random has to be given the row's task). Imports and the environment's own failures are
the environment's, counted and printed like any step's (envs/environment.py).

Its doors: none; an environment file imports OpenEnv from here.
"""

from envs.tool_calls import ToolError


class OpenEnv:
    """The base of an OpenEnv adapter: subclass it with make, action and observe."""

    def make(self, row):
        raise NotImplementedError("make(row): the OpenEnv environment of this row's episode")

    def action(self, text, tool_calls=None):
        raise NotImplementedError("action(text, tool_calls=None): the policy's turn as the environment's Action "
                                  "(tool_calls: its calls as a tool_call_parser read them, when it made any)")

    def observe(self, observation):
        raise NotImplementedError("observe(observation): what the policy reads of an Observation")

    def reset(self, row):
        self.env, self.rewards, self.done, self.seen = self.make(row), [], False, 0
        return [{"role": "user", "content": self.observe(self.env.reset())}]

    def step(self, row, messages):
        # the assistant turns handled so far, counted before the step: a turn refused (action raised
        # a ToolError) is handled too, and reward never steps it, nor one stepped here, again
        self.seen = sum(m["role"] == "assistant" for m in messages)
        turn = messages[-1]
        observation = self.env.step(self.action(turn["content"], *([turn["tool_calls"]] if "tool_calls" in turn
                                                                    else [])))
        self.rewards.append(float(observation.reward or 0.0))
        self.done = bool(observation.done)
        return [] if self.done else [{"role": "user", "content": self.observe(observation)}]

    def reward(self, row, messages):
        if not self.done and sum(m["role"] == "assistant" for m in messages) > self.seen:
            try:  # max_turns or the budget ended it: the environment scores the last turn
                self.step(row, messages)
            except ToolError:  # action refused it: the policy's mistake, which earns nothing more
                pass
        return sum(self.rewards)

    def close(self):
        close = getattr(getattr(self, "env", None), "close", None)
        if callable(close):
            close()
