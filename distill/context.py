"""What the teacher sees that the student does not (context distillation, as the tinker cookbook's
prompt-distillation recipe does it): messages of teacher_context_file (a system prompt, worked examples)
put in the teacher's chat before the prompt's first turn that is not a system message.

    context = Context(tokenizer, load(cfg.teacher_context_file))
    ids = context.prompt(sample.prompt_ids)   # the teacher's prompt; the sample's tokens after it are the student's

The student's prompt ids are all a sample carries of its prompt, so the teacher's prompt is made from
them: the template renders a probe with and without the messages, and where the two part is the splice
(`old` at the student's first user turn becomes `new`). The messages go where the chat puts them:
- after the prompt's own system message, when it has one (a system message of the file then follows it);
- in place of the template's default system prompt (Qwen2.5's, SmolLM2's), when a system message of the
  file takes its place, as the template renders such a chat.
check() compares the splice with the template's own rendering of the teacher's chat, on prompts with
and without a system message, at start-up: a template for which they differ is refused there.
"""

import json

from infra.faults import Refused

MARK = "zq1 + 2zq"  # a user message's text that no template writes


def load(path):
    """The messages of a JSON file (a list of {role, content}) or a JSONL file (one a line); ValueError
    naming the fix."""
    try:
        with open(path) as f:
            text = f.read()
        messages = json.loads(text) if text.lstrip().startswith("[") else [json.loads(x) for x in text.splitlines()
                                                                             if x.strip()]
    except (OSError, ValueError) as e:
        raise ValueError(f"teacher_context_file={path!r} does not load ({type(e).__name__}: {e}); pass a JSON list of "
                         "{role, content} messages or a JSONL file of one a line") from None
    if not messages or not all(isinstance(m, dict) and isinstance(m.get("content"), str) and m.get("role") in
                               ("system", "user", "assistant", "tool") for m in messages):
        raise ValueError(f"teacher_context_file={path!r} holds no messages, or one that is not a {{role, content}} "
                         "message with a role of system, user, assistant or tool")
    return messages


def checked(tokenizer, path):
    """The Context of the file at path, checked (Context.check); ValueError in one line naming the fix."""
    messages = load(path)
    try:
        context = Context(tokenizer, messages)
    except Exception as e:  # noqa: BLE001 - a Jinja template may raise anything (Gemma's: on a system role)
        raise ValueError(f"teacher_context_file={path!r}: the chat template of {tokenizer.name_or_path!r} raises on "
                         f"its messages ({type(e).__name__}: {e}); use roles the template renders") from None
    context.check(path)
    return context


def common(a, b):
    """The length of the common prefix of lists a and b."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


class Context:
    """The teacher's prompt made from the student's by one of two splices (head, old, new), where the
    template puts a prompt's first user turn: `bare` for a prompt without a system message (it starts
    with head + old, the template's own beginning, which may hold a default system prompt that a
    system message of the file then replaces), `system` for one with (old, after the system message,
    is found in it)."""

    def __init__(self, tokenizer, messages):
        self.tokenizer, self.messages = tokenizer, messages
        self.bare, self.system = self.splice([]), self.splice([{"role": "system", "content": "S"}])
        # the tokens the teacher's prompt adds at most (its server's context counts them)
        self.extra = max(len(new) - len(old) for _, old, new in (self.bare, self.system))

    def ids(self, messages):
        """The prompt ids the student's would be for these messages (data.tokenize_rows's)."""
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def splice(self, system):
        """(head, old, new) from a probe prompt A (system, a user message) and the teacher's B (the file's
        messages between them): B = head + new + A[cut + len(old):] with head = A[:cut], `old` running from
        where A and B part to where the user's text begins, so that it names the place in any prompt."""
        user = [{"role": "user", "content": MARK}]
        a, b = self.ids(system + user), self.ids(system + self.messages + user)
        text = common(a, self.ids(system + [{"role": "user", "content": "qz" + MARK}]))  # the user's text begins
        tail = common(a[::-1], b[::-1])  # a common tail: the user's turn on, and what closes the turn before it
        cut = min(common(a, b), len(a) - tail, text)
        return a[:cut], a[cut:text], b[cut:len(b) - (len(a) - text)]

    def prompt(self, prompt_ids):
        """The teacher's prompt ids for a student's prompt ids; Refused (the run stops on every rank, in one
        line) when no splice has its place (a prompt not made by the chat template)."""
        head, old, new = self.bare
        if prompt_ids[:len(head) + len(old)] == head + old:  # the template's beginning: no system message
            return head + new + prompt_ids[len(head) + len(old):]
        _, old, new = self.system  # the first user turn, after the prompt's system message
        for i in range(len(prompt_ids) - len(old) + 1):
            if prompt_ids[i:i + len(old)] == old:
                return prompt_ids[:i] + new + prompt_ids[i + len(old):]
        raise Refused(f"a prompt of {len(prompt_ids)} tokens has no user turn as the chat template opens one "
                      f"({self.tokenizer.decode(prompt_ids[:40])!r}...), so teacher_context_file has no place in it; "
                      "use chat prompts (apply_chat_template=True)")

    def check(self, path):
        """ValueError in one line where the splice differs from the template's own rendering of the teacher's
        chat: a prompt's system message, then the file's messages, then the prompt's other messages."""
        for system in ([], [{"role": "system", "content": "Be brief."}]):
            row = system + [{"role": "user", "content": "What is 214 + 659?"}]
            try:
                spliced = self.prompt(self.ids(row))
            except Refused:  # no place for it: as wrong as a wrong place
                spliced = None
            if spliced != self.ids(system + self.messages + row[len(system):]):
                raise ValueError(f"teacher_context_file={path!r}: the chat template of {self.tokenizer.name_or_path!r} "
                                 f"renders the file's messages before a prompt {'with' if system else 'without'} a "
                                 "system message otherwise than as a splice of the student's prompt; fold the file's "
                                 "messages into the dataset's prompts instead")
