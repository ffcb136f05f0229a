"""Real chat templates (tests/data/templates: Qwen2.5, Llama-3.1, Qwen3, Gemma) through
environments.ChatTokens, with byte-level tokenizers built in code that carry each family's
special tokens: how a turn that ended on any of the model's end-of-sequence tokens is closed,
and the one-line refusals of templates an episode cannot be appended to."""

import os

import pytest

from environments import ChatTokens

TEMPLATES = os.path.join(os.path.dirname(__file__), "data", "templates")
QWEN = dict(specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], eos="<|im_end|>", bos=None)
FAMILIES = {
    "qwen2.5-instruct": QWEN,
    "qwen3": QWEN,
    "smollm2-instruct": QWEN,  # ChatML; a template that renders no tools
    "llama-3.1-instruct": dict(specials=["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                                         "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"],
                               eos="<|eot_id|>", bos="<|begin_of_text|>"),
    "gemma-2-it": dict(specials=["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"], eos="<eos>",
                       bos="<bos>"),
}
TOOL = [{"role": "tool", "content": "873"}]


def family_tokenizer(name):
    """A byte-level tokenizer (every byte one token, no merges) with the family's special tokens,
    EOS and BOS, and its real chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    f = FAMILIES[name]
    vocab = {t: i for i, t in enumerate(f["specials"])}
    for c in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[c] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.add_special_tokens(f["specials"])
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    with open(os.path.join(TEMPLATES, f"{name}.jinja")) as fh:
        template = fh.read()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=f["eos"], bos_token=f["bos"],
                                   chat_template=template, name_or_path=name)


def after(tok, chat, ended):
    """The episode's text from the token that ended the turn (None: a stop string) on."""
    eos_id = tok.convert_tokens_to_ids(ended) if ended else None
    return (ended or "") + tok.decode(chat.ids(TOOL, eos_id))


def test_llama31_a_tool_call_ended_on_eom_is_closed_by_it():
    """Llama-3.1 ends a tool call on <|eom_id|> (generation_config.json lists it) and its template
    writes the tool's answer right after it. Before: <|eot_id|> was appended after <|eom_id|>."""
    tok = family_tokenizer("llama-3.1-instruct")
    chat = ChatTokens(tok)
    answer = '<|start_header_id|>ipython<|end_header_id|>\n\n"873"<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n'
    assert after(tok, chat, "<|eot_id|>") == "<|eot_id|>" + answer
    assert after(tok, chat, "<|eom_id|>") == "<|eom_id|>" + answer
    assert after(tok, chat, None) == "<|eot_id|>" + answer
    # the template's own rendering of a tool call in its ipython mode: <|eom_id|>, then the answer
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "brave_search", "arguments": {"query": "x"}}}]}
    text = tok.apply_chat_template([*ChatTokens.BASE, call, *TOOL], tokenize=False, add_generation_prompt=True,
                                   builtin_tools=["brave_search"])
    assert text.endswith('.call(query="x")<|eom_id|>' + answer)
    # an end-of-sequence token the template never writes is text of the turn: the whole closing follows
    assert after(tok, chat, "<|end_of_text|>") == "<|end_of_text|><|eot_id|>" + answer


def test_qwen25_a_turn_ended_on_endoftext_is_closed_by_im_end():
    """Qwen2.5 may end on <|endoftext|> as well as <|im_end|>: the template never writes
    <|endoftext|>, so the turn keeps it and is closed as the template closes any turn."""
    tok = family_tokenizer("qwen2.5-instruct")
    chat = ChatTokens(tok)
    answer = "<|im_start|>user\n<tool_response>\n873\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert after(tok, chat, "<|im_end|>") == "<|im_end|>\n" + answer
    assert after(tok, chat, None) == "<|im_end|>\n" + answer
    assert after(tok, chat, "<|endoftext|>") == "<|endoftext|><|im_end|>\n" + answer
    # which is the template's rendering of a turn whose text ends with that token
    turn = {"role": "assistant", "content": "A<|endoftext|>"}
    text = tok.apply_chat_template([*ChatTokens.BASE, turn, *TOOL], tokenize=False, add_generation_prompt=True)
    assert text.endswith("A<|endoftext|><|im_end|>\n" + answer)


NUMBERED = ("{% for m in messages %}<|im_start|>{{ m.role }}{% if m.role == 'tool' %} {{ loop.index }}{% endif %}\n"
            "{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.parametrize("name,cause", [
    ("numbered", "renders a tool message after an assistant turn differently with earlier turns "
                 "('4T<|im_end|>\\n<|im_start|>assistant\\n' becomes '6T<|im_end|>"),
    ("gemma-2-it", "raises on a conversation of system, user, assistant and tool messages "
                   "(TemplateError: System role not supported)"),
])
def test_templates_an_episode_cannot_grow_on_are_refused_naming_why(name, cause):
    """A template that numbers its tool messages renders an environment's answer by the turns before
    it; Gemma's raises on a system or tool message."""
    tok = family_tokenizer("qwen2.5-instruct" if name == "numbered" else name)
    if name == "numbered":
        tok.chat_template, tok.name_or_path = NUMBERED, name
    with pytest.raises(ValueError) as refused:
        ChatTokens(tok)
    message = str(refused.value)
    assert cause in message and "\n" not in message and message.startswith(f"the chat template of '{name}'")


def test_qwen3_appends_the_same_messages_whatever_the_turn_before_held():
    """Qwen3's template writes a turn by its place (an empty <think> block on a final turn without
    one; the reasoning of turns before the last user message dropped), but what it writes after an
    assistant turn depends on the messages that follow only: accepted, its tool answer as the
    template renders it."""
    tok = family_tokenizer("qwen3")
    chat = ChatTokens(tok)
    assert chat.close == "<|im_end|>\n"
    assert tok.decode(chat.ids(TOOL, tok.eos_token_id)) == (
        "\n<|im_start|>user\n<tool_response>\n873\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
