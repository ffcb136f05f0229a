"""The tokens a conversation adds to an episode, from the model's chat template (ChatTokens):
the environment's messages after a policy's turn, checked at start-up to be appendable turn by
turn. envs/environment.py builds one per run, agent_programs/gateway.py one per tool list; tests/test_templates.py runs the families' real
templates through it."""

import re
import uuid


class ChatTokens:
    """The tokens an environment's messages add to an episode, from the chat template.

    The policy's turns stay the tokens it sampled (what vLLM saw). After a turn, the environment's
    messages are appended as the template renders them after an assistant turn: the turn's closing
    (ChatML: "<|im_end|>\\n"), the messages, the next generation prompt; that text is read off a
    rendering of a fixed conversation, from the end of a marked assistant turn on. Start-up checks
    what this needs: the text after an assistant turn is the same whatever that turn held (its
    reasoning) and whatever came before it (earlier turns), for a tool message and a user message
    alike; a template for which it is not is refused, naming where. A template may still rewrite
    earlier turns when it renders a whole conversation (Qwen3's drops the reasoning of the turns
    before the last user message, and adds an empty <think> block to a final turn without one):
    the episode keeps them as sampled, which is the context the policy had."""

    BASE = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    TURN = "A1 turn"  # the marked assistant turn's text
    PROBES = {"a tool message": [{"role": "tool", "content": "T"}], "a user message": [{"role": "user", "content": "F"}]}
    EARLIER = {"its reasoning": ([], "<think>\nR\n</think>\n\n" + TURN),
               "earlier turns": ([{"role": "assistant", "content": "A0"}, {"role": "tool", "content": "T0"}], TURN)}

    def __init__(self, tokenizer, tools=None):
        self.tokenizer, self.tools = tokenizer, tools
        if not tokenizer.chat_template:
            raise ValueError(f"an environment's episodes are conversations, and the tokenizer of "
                             f"{tokenizer.name_or_path!r} has no chat template; use a chat model")
        try:
            self.close = self.after([])  # what the template puts after a final assistant turn
            problem = self.drift()
        except Exception as e:  # noqa: BLE001 - a Jinja template may raise anything (Gemma's: on a system role)
            raise ValueError(f"the chat template of {tokenizer.name_or_path!r} raises on a conversation of system, "
                             f"user, assistant and tool messages ({type(e).__name__}: {e}); an environment needs a "
                             "model whose template renders them") from None
        if problem:
            raise ValueError(f"the chat template of {tokenizer.name_or_path!r} {problem}, so an episode's tokens "
                             "cannot be appended turn by turn; use a model whose template does (ChatML's does), or "
                             "write one into the model directory's chat_template.jinja")
        # the closing's first token (ChatML's <|im_end|>, Llama-3's <|eot_id|>), which a sampled end-of-sequence
        # token may stand for (ids)
        self.closing_token = tokenizer.decode(tokenizer(self.close, add_special_tokens=False)["input_ids"][:1])
        # the tokens added to the vocabulary: control tokens (<|im_start|>, <|eot_id|>) and markers (Qwen's
        # <tool_call>, <tool_response>, <think>): in an environment's text they stay text (ids)
        added = sorted({t.content for t in tokenizer.added_tokens_decoder.values()}, key=len)
        self.specials = re.compile("|".join(map(re.escape, reversed(added)))) if added else None
        self.mark, self.roles = f"zq{uuid.uuid4().hex}zq", {}  # a string no text holds; role -> rendered?

    def drift(self):
        """Where the text after an assistant turn depends on more than the messages that follow it,
        in words; None when it does not."""
        def differ(a, b):  # the two texts from where they part
            i = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            return f"{a[i:i + 40]!r} becomes {b[i:i + 40]!r}"
        if self.close is None:
            return "does not render an assistant turn's text as it is"
        for what, probe in self.PROBES.items():
            after = self.after(probe)
            if after is None:
                return f"drops an assistant turn that {what} follows"
            if not after.startswith(self.close):
                return f"closes an assistant turn that {what} follows differently ({differ(self.close, after)})"
            for earlier, (history, turn) in self.EARLIER.items():
                other = self.after(probe, history, turn)
                if other != after:
                    return (f"renders {what} after an assistant turn differently with {earlier} "
                            f"({differ(after, other or '')})")
        return None

    def render(self, messages, generation_prompt=False):
        return self.tokenizer.apply_chat_template(messages, tools=self.tools, tokenize=False,
                                                  add_generation_prompt=generation_prompt)

    def after(self, messages, history=(), turn=TURN):
        """The template's text after an assistant turn `turn` (following BASE and history), through
        the messages and, when there are any, the next generation prompt; None when the turn's text
        is not in the rendering."""
        text = self.render([*self.BASE, *history, {"role": "assistant", "content": turn}, *messages], bool(messages))
        i = text.find(self.TURN)
        return None if i < 0 else text[i + len(self.TURN):]

    def renders(self, role):
        """Whether the template renders the content of a message with this role after an assistant
        turn (Qwen's drop an "observation" or "environment" message without a word)."""
        if role not in self.roles:
            try:
                self.roles[role] = self.mark in (self.after([{"role": role, "content": self.mark}]) or "")
            except Exception:  # noqa: BLE001 - a template may raise on a role it does not know
                self.roles[role] = False
        return self.roles[role]

    def check_first(self, messages, spec):
        """ValueError in one line for an environment's first message (rendered as the prompt) whose
        content the template leaves out."""
        marked = [dict(m, content=f"{self.mark}{i}{self.mark}") for i, m in enumerate(messages)]
        text = self.render(marked, generation_prompt=True)
        for i, m in enumerate(messages):
            if m["content"] and f"{self.mark}{i}{self.mark}" not in text:
                raise ValueError(f"environment={spec!r} starts with a {m['role']!r} message that the chat template "
                                 f"of {self.tokenizer.name_or_path!r} leaves out of the prompt (the policy would never "
                                 "see it); use a 'system' or 'user' message")

    def generation_prompt(self):
        """The text the template adds to open the assistant's turn (Qwen3-Thinking's ends in <think>)."""
        return self.render(self.BASE, generation_prompt=True)[len(self.render(self.BASE)):]

    def check_roles(self, messages, spec):
        """ValueError in one line for a message whose content the template would never show the policy."""
        for m in messages:
            if m["content"] and not self.renders(m["role"]):
                raise ValueError(f"environment={spec!r} answers with a {m['role']!r} message, which the chat template "
                                 f"of {self.tokenizer.name_or_path!r} does not render (the policy would never see it); "
                                 "answer with a 'tool' or 'user' message")

    def ids(self, messages, eos_id=None):
        """Token ids of the environment's messages after an assistant turn, through the next
        generation prompt. The turn ended on eos_id, an end-of-sequence token it keeps (sampled,
        mask 1), or on a stop string or the token budget (None): the template's closing follows.
        An eos_id the template writes itself is a closing: the template's own (ChatML's
        <|im_end|>: its "\\n" follows), or one it writes in another mode (Llama-3.1's <|eom_id|>
        ends a tool call where <|eot_id|> ends a turn; nothing of <|eot_id|> follows it). An
        eos_id the template never writes (Qwen2.5's <|endoftext|>, Llama-3.1's <|end_of_text|>)
        is text of the turn, and the whole closing follows it, as the template renders a turn
        that ends with that text."""
        messages, hidden = self.hide(messages)
        text = self.after(messages)
        ended = self.tokenizer.decode([eos_id]) if eos_id is not None else ""
        if ended and text.startswith(ended):
            text = text[len(ended):]
        elif ended and ended in str(self.tokenizer.chat_template) and text.startswith(self.closing_token):
            text = text[len(self.closing_token):]  # the token that ended the turn in place of the closing's
        return self.encode(text, hidden)

    def prompt_ids(self, messages):
        """Token ids of an environment's first messages rendered as the prompt (generation prompt
        included), its control-token strings kept as text as in ids."""
        messages, hidden = self.hide(messages)
        return self.encode(self.render(messages, generation_prompt=True), hidden)

    def hide(self, messages):
        """The messages with each control-token string in their content replaced by a mark, and the
        strings the marks stand for."""
        hidden = []

        def mark(match):
            hidden.append(match.group())
            return f"{self.mark}{len(hidden) - 1}{self.mark}"
        if self.specials:
            messages = [dict(m, content=self.specials.sub(mark, m["content"])) for m in messages]
        return messages, hidden

    def encode(self, text, hidden):
        """The template's text as it is (its own control tokens), a mark as the plain text of the string
        it hides: "<|im_start|>user" that a tool printed is characters to the policy, never a new turn."""
        parts, ids = re.split(f"{self.mark}(\\d+){self.mark}", text), []
        for i, part in enumerate(parts):
            if i % 2 == 0:
                ids += self.tokenizer(part, add_special_tokens=False)["input_ids"]
                continue
            # split_special_tokens splits control tokens only: a marker (<tool_call>) is split by its first
            # character, which no added token's text spans
            part = hidden[int(part)]
            for piece in (part[:1], part[1:]):
                ids += self.tokenizer(piece, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        return ids
