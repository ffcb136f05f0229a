"""Environments others wrote: an OpenEnv environment (openenv-core's Environment, `reset()` and
`step(action)` returning observations that carry `done` and `reward`), run unmodified, in
process, as a per-episode environment of this trainer.

    # dipg.py: --environment dipg.py:DIPG (a class: one OpenEnv environment per episode)
    from openenv_adapter import OpenEnv

    class DIPG(OpenEnv):
        def make(self, row):                  # the row's environment, built by the episode's first call
            return DIPGEnvironment(dataset=Dataset.from_list([...row...]), ...)
        def action(self, text):               # the policy's turn as the environment's Action
            return DIPGAction(llm_response=text)
        def observe(self, observation):       # an Observation as the text the policy reads
            return f"{observation.context}\\n\\n{observation.question}"

Each episode: `make(row)` then the environment's `reset()`, whose observation is the first user
message; each policy turn is `step(action(text))`, whose observation comes back as a user message
until it says `done`; the episode's reward is the sum of the rewards its steps returned. When
max_turns or the token budget ended the episode before the environment did, its final turn is
stepped at the end, so that the environment scores it (a one-turn environment, max_turns 1,
scores that way). OpenEnv has no messages of its own: `observe` writes what the policy sees.
The prompt is rendered once per row from a separate instance, so `make(row)` must give the same
first observation for the same row (an environment that draws its task at random has to be
given the row's task). Imports and the environment's own failures are the environment's, counted
and printed like any step's (environments.py).
"""


class OpenEnv:
    """The base of an OpenEnv adapter: subclass it with make, action and observe."""

    def make(self, row):
        raise NotImplementedError("make(row): the OpenEnv environment of this row's episode")

    def action(self, text):
        raise NotImplementedError("action(text): the policy's turn as the environment's Action")

    def observe(self, observation):
        raise NotImplementedError("observe(observation): what the policy reads of an Observation")

    def reset(self, row):
        self.env, self.rewards, self.done, self.stepped = self.make(row), [], False, 0
        return [{"role": "user", "content": self.observe(self.env.reset())}]

    def step(self, row, messages):
        observation = self.env.step(self.action(messages[-1]["content"]))
        self.stepped += 1
        self.rewards.append(float(observation.reward or 0.0))
        self.done = bool(observation.done)
        return [] if self.done else [{"role": "user", "content": self.observe(observation)}]

    def reward(self, row, messages):
        if not self.done and sum(m["role"] == "assistant" for m in messages) > self.stepped:
            self.step(row, messages)  # max_turns or the budget ended it: the environment scores the last turn
        return sum(self.rewards)

    def close(self):
        close = getattr(getattr(self, "env", None), "close", None)
        if callable(close):
            close()
