"""An agent's episode as the gateway records it: one Trace per episode, its calls' tokens in one
Sample, and the messages of its calls compared as the chat template reads them.

What is recorded, per episode, is one Sample (episodes.py) of the tokens vLLM saw and sampled:
- the first call's prompt, rendered by the chat template (with the call's tools), is the
  sample's prompt;
- a call whose messages extend the previous call's messages and the reply the gateway gave
  (compared as the template reads them: role, text, tool calls' names and arguments, ids
  aside) continues the sample: its new messages are appended as the chat template renders them
  after an assistant turn (envs.chat.ChatTokens, mask 0) and the sampled tokens follow (mask 1). The
  earlier turns stay the tokens sampled, whatever the template would now render for them
  (Qwen3 drops past reasoning; JSON arguments re-serialise);
- a call that does not extend (history rewritten, compacted, a sub-agent's) starts a new
  sequence in the same sample: its prompt rendered whole (mask 0) where positions restart
  (Sample.restarts), so it attends to nothing before it and shares the episode's advantage.
The sample's tokens after its first prompt stay within response_length and its calls within
max_turns: past either, a call is answered with no text and finish_reason "length", unsampled.

Doors: gateway.py (a Trace opened and closed per episode; each call's tokens recorded by
Trace.record; Refusal, the HTTP error of a call); runner.Agents.take reads a closed trace.
"""

import dataclasses
import json
import threading

from episodes import completion_text
from episodes import Sample


class Refusal(Exception):
    """A call the gateway answers with an HTTP error; `fatal` ones leave the episode unscored."""

    def __init__(self, status, message, fatal=False):
        super().__init__(message)
        self.status, self.fatal = status, fatal


def text_of(content):
    """A message's content as text: a string, None, or OpenAI's list of text parts."""
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise Refusal(400, f"a message's content must be text or a list of text parts, not {str(content)[:80]}")
        return "".join(p["text"] for p in content)
    if content is not None and not isinstance(content, str):
        raise Refusal(400, f"a message's content must be text, not {type(content).__name__}")
    return content or ""


def arguments(value):
    """A tool call's arguments as the chat template takes them (a dict), from OpenAI's JSON string."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def plain(message):
    """A message as the chat template renders it: role, text, name, tool_call_id, tool_calls."""
    m = {"role": message.get("role"), "content": text_of(message.get("content"))}
    m.update({k: message[k] for k in ("name", "tool_call_id") if message.get(k)})
    if message.get("tool_calls"):
        m["tool_calls"] = [{"id": c.get("id"), "type": "function",
                            "function": {"name": c["function"]["name"], "arguments": arguments(c["function"].get(
                                "arguments"))}} for c in message["tool_calls"]]
    return m


def same(a, b):
    """Whether two plain messages render alike (tool call ids aside)."""
    calls = lambda m: [(c["function"]["name"], c["function"]["arguments"]) for c in m.get("tool_calls", [])]  # noqa
    return (a["role"], a["content"], a.get("name"), calls(a)) == (b["role"], b["content"], b.get("name"), calls(b))


class Trace:
    """One episode's calls: its sample, the conversation the sample holds (the messages of the
    last call and the gateway's reply), and what the reward reads."""

    def __init__(self, temperature, seeds):
        self.temperature, self.seeds, self.lock = temperature, seeds, threading.Lock()  # held for a whole call
        self.closed, self.in_flight = False, None  # in_flight: the request id of the call being sampled
        self.sample, self.convo, self.tools, self.eos, self.text = None, None, None, None, ""
        self.messages, self.completion, self.calls, self.tool_calls, self.cut = [], "", 0, 0, False
        self.failure, self.overrides, self.server_error = None, 0, None

    def current(self):
        """The tokens of the sample's last sequence (what vLLM saw and sampled since its last restart)."""
        s = self.sample
        return s.token_ids[s.restarts[-1]:] if s.restarts else s.prompt_ids + s.token_ids

    def save(self):
        """What one call changes, to take it back if its answer never reached the agent."""
        s = self.sample
        state = {k: v for k, v in vars(self).items() if k not in ("lock", "closed", "in_flight")}
        return dict(state, sample=s and dataclasses.replace(
            s, token_ids=list(s.token_ids), logprobs=list(s.logprobs), mask=list(s.mask)))

    def load(self, state):
        """Take a call back; a server's failure in it stays, with the episode's failure: the trainer
        stops the step on it (runner.Agents.play), whether the agent saw the answer or not."""
        error, failure = self.server_error, self.failure
        vars(self).update(state)
        if error is not None:
            self.server_error, self.failure = error, failure

    def add(self, ids, logprobs=None, version=None):
        s = self.sample
        s.token_ids += ids
        s.logprobs += logprobs or [0.0] * len(ids)
        s.mask += [int(logprobs is not None)] * len(ids)
        if version is not None:
            s.versions += (version,)

    def continues(self, messages, tools):
        """Whether a chat call's messages extend the conversation the sample holds, its tools (as JSON)
        unchanged: the tools the template shows are part of the prompt."""
        return self.convo is not None and self.tools == tools and len(messages) > len(self.convo) and all(
            map(same, messages, self.convo))

    def record(self, between, extends, out, stop, tokenizer, response_length):
        """Append a call's tokens: between (mask 0), then what vLLM sampled (mask 1), continuing the
        sample's last sequence or (not extends) starting one; (the sampled ids, finish_reason). An
        answer without one logprob per sampled token is a ValueError, as in episodes.Episode.add,
        raised before anything is recorded (the gateway takes it as the server's failure)."""
        if len(out["logprobs"]) != len(out["token_ids"]):
            raise ValueError(f"the server returned {len(out['token_ids'])} token ids and {len(out['logprobs'])} "
                             "logprobs for one turn")
        s = self.sample
        if s is None:
            self.sample = Sample(list(between), [], [], [], versions=(), restarts=())
        else:
            if not extends:
                self.sample.restarts += (len(s.token_ids),)
            self.add(list(between))
        self.add(out["token_ids"], out["logprobs"], out["version"])
        self.convo = None  # until Gateway.chat sets the conversation this call ends
        self.calls, self.eos = self.calls + 1, out["token_ids"][-1] if out.get("eos") else None
        text = completion_text(tokenizer, out)
        hit = next((x for x in stop if out["finish_reason"] == "stop" and not out.get("eos") and text.endswith(x)), "")
        self.text = text[:len(text) - len(hit)]  # as OpenAI answers: without the stop string (in the tokens, sampled)
        length = out["finish_reason"] == "length"
        self.cut = length or len(self.sample.token_ids) >= response_length
        return out["token_ids"], "length" if length else "stop"

