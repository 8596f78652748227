"""A request's text, grown one token at a time: what stop strings and streaming read.

One :class:`IncrementalDetokenizer` per request, attached by ``LLM`` (which owns the tokenizer) and
fed by the request itself as tokens are accepted, so the engine stays free of text while a stop
string still ends a request in the step that completed it (its pages freed at once). A server
or the CLI reads the new text of each step with :meth:`IncrementalDetokenizer.take_delta`.

Decoding: the text of tokens ``[prefix:]`` minus that of ``[prefix:read]`` is what the newest
tokens add, and it is kept only once it no longer ends in U+FFFD (a byte-level token that ends in
the middle of a UTF-8 character waits for the rest). Decoding a short window, not the whole
output, keeps a step's cost independent of the output's length; decoding the window together
with the token before it keeps the tokenizer's context (a leading space, a merged byte).
The text grown this way is ``tokenizer.decode(generated, skip_special_tokens=True)``.

Stop strings follow vLLM: after each token the text is searched from just before its new
characters; a hit cuts the text before the stop string (after it with
``include_stop_str_in_output``). While streaming, the last ``len(longest stop) - 1`` characters
are held back until they cannot start a stop string, so a client never sees text that is then
cut away; the streamed pieces always concatenate to the final text.
"""

from __future__ import annotations

from typing import Sequence


class IncrementalDetokenizer:
    """The generated text of one request, with stop strings. ``tokenizer``: a ``tokenizers.Tokenizer``."""

    def __init__(self, tokenizer, *, stop: Sequence[str] = (), include_stop_str_in_output: bool = False):
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._prefix = 0              # window start: the token before the undecoded ones (context)
        self._read = 0                # tokens whose text is in self.text
        self._prefix_text = ""        # decode(ids[prefix:read]), kept to subtract
        self.stop = tuple(stop)
        self.include_stop_str_in_output = bool(include_stop_str_in_output)
        self.text = ""
        self.stop_reason: str | None = None   # the stop string that ended the text
        self.finished = False
        self._holdback = 0 if self.include_stop_str_in_output or not self.stop else max(map(len, self.stop)) - 1
        self._emitted = 0             # characters handed out by take_delta

    def _decode(self, ids) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token: int) -> bool:
        """Appends ``token``'s text; True when a stop string now ends the text (then it is finished)."""
        if self.finished:
            raise RuntimeError("IncrementalDetokenizer.add after the text finished")
        self._ids.append(int(token))
        new_text = self._decode(self._ids[self._prefix:])
        if len(new_text) <= len(self._prefix_text) or new_text.endswith("\ufffd"):
            return False  # nothing printable yet: an incomplete character, or a skipped special token
        added = new_text[len(self._prefix_text):]
        self.text += added
        self._prefix, self._read = self._read, len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix:self._read])
        return self._check_stop(len(added))

    def _check_stop(self, new_chars: int) -> bool:
        for stop in self.stop:  # in the caller's order, as vLLM (not the earliest position)
            at = self.text.find(stop, max(0, len(self.text) - new_chars - len(stop) + 1))
            if at < 0:
                continue
            self.text = self.text[:at + len(stop) if self.include_stop_str_in_output else at]
            self.stop_reason = stop
            self.finished = True
            return True
        return False

    def finish(self) -> None:
        """The request ended (length, stop token): the text takes whatever its last tokens decode to,
        a trailing incomplete character included (as a whole decode would)."""
        if self.finished:
            return
        if self._read < len(self._ids):
            new_text = self._decode(self._ids[self._prefix:])
            if len(new_text) > len(self._prefix_text):
                added = new_text[len(self._prefix_text):]
                self.text += added
                self._read = len(self._ids)
                self._check_stop(len(added))
        self.finished = True

    def take_delta(self) -> str:
        """Text not handed out before, minus what could still turn out to start a stop string."""
        end = len(self.text) if self.finished else max(self._emitted, len(self.text) - self._holdback)
        delta = self.text[self._emitted:end]
        self._emitted = end
        return delta
