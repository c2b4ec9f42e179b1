"""How a request's prompt and completion fit the model's context (`context_length` tokens,
prompt and completion together), checked before the request is admitted.

A prompt that leaves no room for one completion token is refused, whatever the API. A
`max_tokens` the client gave that the context cannot hold after the prompt is refused too when
the request asks for that (`refuse_past_context`), as OpenAI's API and vLLM's OpenAI server
refuse it ("This model's maximum context length is N tokens. However, you requested M tokens
(P in the messages, C in the completion)..."); otherwise, and whenever max_tokens is the
model's default, the completion is clamped to what the context leaves (it then ends with finish
reason `length`), as Triton's LLM backends clamp it. Both refusals are ContextLengthExceeded
with OpenAI's wording: "in the messages" for a chat, "in your prompt"
for a prompt."""

from __future__ import annotations

from engine.errors import ContextLengthExceeded


def completion_budget(
    prompt_tokens: int,
    max_tokens: int,
    context: int,
    *,
    requested: bool = False,
    chat: bool = False,
) -> int:
    """The completion tokens a sequence of `prompt_tokens` may generate: `max_tokens` clamped to
    what the context leaves. ContextLengthExceeded for a prompt that leaves no
    room, and for `max_tokens` past the room when it is `requested` (the client asked for it and
    the API refuses what does not fit); `chat` words the message for messages, not a prompt."""
    room = context - prompt_tokens
    if room < 1:
        raise ContextLengthExceeded(_prompt_too_long(prompt_tokens, context, chat))
    if requested and max_tokens > room:
        raise ContextLengthExceeded(_completion_too_long(prompt_tokens, max_tokens, context, chat))
    return min(max_tokens, room)


def _prompt_too_long(prompt_tokens: int, context: int, chat: bool) -> str:
    what, reduce = _prompt_words(chat)
    # The facts the earlier message gave (the prompt's tokens, the context, the most a prompt may
    # have) follow OpenAI's wording, which clients match on.
    return (
        f"This model's maximum context length is {context} tokens. However, your {what} "
        f"resulted in {prompt_tokens} tokens. Please reduce {reduce}: the context holds the "
        f"prompt and the completion together, so a prompt may have at most {context - 1} tokens"
    )


def _completion_too_long(prompt_tokens: int, max_tokens: int, context: int, chat: bool) -> str:
    total = prompt_tokens + max_tokens
    if chat:
        counts = f"{prompt_tokens} in the messages, {max_tokens} in the completion"
        reduce = "the length of the messages or completion"
    else:
        counts = f"{prompt_tokens} in your prompt; {max_tokens} for the completion"
        reduce = "your prompt or completion length"
    return (
        f"This model's maximum context length is {context} tokens. However, you requested "
        f"{total} tokens ({counts}). Please reduce {reduce}: after this prompt the completion "
        f"may have at most {context - prompt_tokens} tokens"
    )


def check_prompt_chars(chars: int, most: int, context: int, chat: bool) -> None:
    """ContextLengthExceeded for a prompt text of `chars` characters, more than
    `most` (ModelText.most_chars: more than any text of `context` tokens has), refused without
    tokenizing it: a tokenizer takes about 0.5 s a MiB."""
    if chars > most:
        what, reduce = _prompt_words(chat)
        raise ContextLengthExceeded(
            f"This model's maximum context length is {context} tokens. However, your {what} "
            f"has {chars} characters, more than {context} tokens of this model ever hold (at "
            f"most {most}). Please reduce {reduce}"
        )


def _prompt_words(chat: bool) -> tuple[str, str]:
    """What a prompt is called, and what to reduce, in OpenAI's messages."""
    return ("messages", "the length of the messages") if chat else ("prompt", "your prompt")
